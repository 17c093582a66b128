{{/* The SLO planner (planner.enabled): names, the routers' metrics URLs, RBAC rules, checks. */}}
{{- define "pdserve.plannerName" -}}
{{ include "pdserve.fullname" . }}-planner
{{- end -}}

{{/* Headless Services (clusterIP: None) whose DNS names resolve to every router pod's IP: the
     router Deployment's pods, and in raycluster mode also the head (`serve` runs a router there). */}}
{{- define "pdserve.routerMetricsTargets" -}}
{{- $targets := list (dict "name" (printf "%s-router-metrics" (include "pdserve.fullname" .)) "component" "router") -}}
{{- if eq .Values.mode "raycluster" -}}
{{- $targets = append $targets (dict "name" (printf "%s-head-metrics" (include "pdserve.fullname" .)) "component" "ray-head") -}}
{{- end -}}
{{- toJson $targets -}}
{{- end -}}

{{/* --router-metrics: comma-separated URLs, one per headless Service. */}}
{{- define "pdserve.plannerRouterMetrics" -}}
{{- $urls := list -}}
{{- range (include "pdserve.routerMetricsTargets" . | fromJsonArray) -}}
{{- $urls = append $urls (printf "http://%s.%s.svc:%d/metrics" .name $.Release.Namespace (int $.Values.router.metricsPort)) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}

{{/* Exactly what planner/kubernetes_scaler.py calls: deployments mode reads the Deployments (status)
     and their scale subresource, patches the scale, lists the pool's pods and annotates the idlest
     (pod-deletion-cost); raycluster mode reads and JSON-patches the RayCluster and lists its pods.
     Pod names are not known in advance and list cannot be restricted by name. */}}
{{- define "pdserve.plannerRules" -}}
{{- $full := include "pdserve.fullname" . -}}
{{- if eq .Values.mode "deployments" -}}
- apiGroups: [apps]
  resources: [deployments]
  resourceNames: [{{ $full }}-prefill, {{ $full }}-decode]
  verbs: [get]
- apiGroups: [apps]
  resources: [deployments/scale]
  resourceNames: [{{ $full }}-prefill, {{ $full }}-decode]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, patch]
{{- else -}}
- apiGroups: [ray.io]
  resources: [rayclusters]
  resourceNames: [{{ $full }}]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
{{- end }}
{{- end -}}

{{/* planner.<role>.min <= max, and the pools start within those bounds. */}}
{{- define "pdserve.checkPlanner" -}}
{{- range $role := list "prefill" "decode" -}}
{{- $b := index $.Values.planner $role -}}
{{- $n := int (index $.Values $role).replicas -}}
{{- if gt (int $b.min) (int $b.max) -}}
{{- fail (printf "planner.%s.min (%d) must not exceed planner.%s.max (%d)" $role (int $b.min) $role (int $b.max)) -}}
{{- end -}}
{{- if or (lt $n (int $b.min)) (gt $n (int $b.max)) -}}
{{- fail (printf "%s.replicas=%d must lie within planner.%s.min..max (%d..%d): the planner keeps the pool there" $role $n $role (int $b.min) (int $b.max)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
