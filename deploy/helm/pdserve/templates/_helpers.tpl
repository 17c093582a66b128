{{/* Names and labels. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of every object; pass (dict "root" $ "component" "router"). */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* --model argument: the bundled model or the checkpoint under the model volume. */}}
{{- define "pdserve.modelPath" -}}
{{- if eq .Values.model.source "bundled" -}}
default
{{- else -}}
{{ .Values.model.mountPath }}/{{ .Values.model.subPath }}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisHost" -}}
{{ include "pdserve.fullname" . }}-redis
{{- end -}}

{{/* The Secret (name, key) holding the bundled Redis's password: the named one or the generated one. */}}
{{- define "pdserve.redisPasswordSecretName" -}}
{{- .Values.redis.bundled.passwordSecret.name | default (printf "%s-redis-auth" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* Env entries giving $(PDSERVE_REDIS_URL) and REDIS_PASSWORD, which pdserve reads from its
     environment: the password comes from its Secret and never reaches a command line. */}}
{{- define "pdserve.redisEnv" -}}
{{- if eq .Values.redis.mode "bundled" -}}
- name: PDSERVE_REDIS_URL
  value: redis://{{ include "pdserve.redisHost" . }}:6379/0
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisPasswordSecretName" . }}
      key: {{ .Values.redis.bundled.passwordSecret.key }}
{{- else -}}
- name: PDSERVE_REDIS_URL
  value: {{ .Values.redis.external.url | quote }}
{{- with .Values.redis.external.passwordSecret.name }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.external.passwordSecret.key }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The cluster secret (router <-> worker gRPC tokens, KV handshake, KV handle signatures): the named
     Secret or the generated one, given to every pdserve container through its environment. */}}
{{- define "pdserve.clusterSecretName" -}}
{{- .Values.clusterSecret.name | default (printf "%s-cluster-secret" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{- define "pdserve.clusterSecretEnv" -}}
- name: PDSERVE_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.clusterSecretName" . }}
      key: {{ .Values.clusterSecret.key }}
{{- end -}}

{{/* Mutual TLS inside the release (internalTLS): one certificate for routers and workers, named
     <fullname>-internal; mounted at /etc/pdserve/internal-tls. */}}
{{- define "pdserve.internalName" -}}
{{ include "pdserve.fullname" . }}-internal
{{- end -}}

{{- define "pdserve.internalTLSSecretName" -}}
{{- .Values.internalTLS.existingSecret | default (printf "%s-internal-tls" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* "true" when the chart makes the internal CA and certificate itself (no existingSecret, no cert-manager). */}}
{{- define "pdserve.internalTLSGenerated" -}}
{{- $t := .Values.internalTLS -}}
{{- if and $t.enabled (not $t.existingSecret) (not $t.certManager.issuerRef.name) -}}true{{- end -}}
{{- end -}}

{{- define "pdserve.internalTLSVolume" -}}
{{- if .Values.internalTLS.enabled }}
- name: internal-tls
  secret:
    secretName: {{ include "pdserve.internalTLSSecretName" . }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end -}}

{{- define "pdserve.internalTLSMount" -}}
{{- if .Values.internalTLS.enabled }}
- {name: internal-tls, mountPath: /etc/pdserve/internal-tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* Flags naming the mounted files: --internal-tls-cert, -key, -ca, and with "serverName" the name checked
     in the peers' certificates (routers and `serve`). Workers: their gRPC port and KV links speak mutual
     TLS; routers present the certificate to workers and check theirs by its name; `serve` (raycluster
     head): its router and the worker actors it places use the files, mounted on every Ray pod.
     Pass (dict "root" $ "serverName" true|false). */}}
{{- define "pdserve.internalTLSArgs" -}}
{{- if .root.Values.internalTLS.enabled }}
{{- range $part := list "cert" "key" "ca" }}
- --internal-tls-{{ $part }}
- /etc/pdserve/internal-tls/{{ get (dict "cert" "tls.crt" "key" "tls.key" "ca" "ca.crt") $part }}
{{- end }}
{{- if .serverName }}
- --internal-tls-server-name
- {{ include "pdserve.internalName" .root }}
{{- end }}
{{- end }}
{{- end -}}

{{/* With a read-only root filesystem: caches and Ray's session files go to the /tmp emptyDir. */}}
{{- define "pdserve.writableEnv" -}}
- name: HOME
  value: /tmp
{{- end -}}

{{- define "pdserve.tmpVolume" -}}
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "pdserve.tmpMount" -}}
- {name: tmp, mountPath: /tmp}
{{- end -}}

{{/* The shm emptyDir of worker pods, bounded by shm.sizeLimit. */}}
{{- define "pdserve.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    {{- with .Values.shm.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end -}}

{{/* Router flags, volumes and mounts of the public fronts' TLS and API keys. */}}
{{- define "pdserve.tlsSecretName" -}}
{{- .Values.tls.existingSecret | default (printf "%s-router-tls" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{- define "pdserve.frontArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert-file
- /etc/pdserve/tls/tls.crt
- --tls-key-file
- /etc/pdserve/tls/tls.key
{{- end }}
{{- if .Values.auth.existingSecret }}
- --api-keys-file
- /etc/pdserve/auth/{{ .Values.auth.secretKey }}
{{- end }}
{{- end -}}

{{- define "pdserve.frontVolumes" -}}
{{- if .Values.tls.enabled }}
- name: router-tls
  secret:
    secretName: {{ include "pdserve.tlsSecretName" . }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- if .Values.auth.existingSecret }}
- name: api-keys
  secret:
    secretName: {{ .Values.auth.existingSecret }}
    items:
      - {key: {{ .Values.auth.secretKey }}, path: {{ .Values.auth.secretKey }}}
{{- end }}
{{- end -}}

{{- define "pdserve.frontMounts" -}}
{{- if .Values.tls.enabled }}
- {name: router-tls, mountPath: /etc/pdserve/tls, readOnly: true}
{{- end }}
{{- if .Values.auth.existingSecret }}
- {name: api-keys, mountPath: /etc/pdserve/auth, readOnly: true}
{{- end }}
{{- end -}}

{{/* Engine flags every worker (and `serve`) takes. */}}
{{- define "pdserve.engineArgs" -}}
- --model
- {{ include "pdserve.modelPath" . | quote }}
- --dtype
- {{ .Values.model.dtype }}
- --device
- {{ .Values.model.device }}
- --block-size
- {{ .Values.model.blockSize | quote }}
- --kv-cache-memory-gib
- {{ .Values.model.kvCacheMemoryGiB | quote }}
{{- if ne (.Values.model.kvCacheDtype | default "auto") "auto" }}
- --kv-cache-dtype
- {{ .Values.model.kvCacheDtype }}
{{- end }}
{{- with .Values.model.maxModelLen }}
- --max-model-len
- {{ . | quote }}
{{- end }}
{{- with .Values.model.quantization }}
- --quantization
- {{ . }}
{{- end }}
{{- end -}}

{{- define "pdserve.terminationGracePeriodSeconds" -}}
{{ add .root.Values.shutdown.preStopSleepSeconds .drainTimeoutSeconds 15 }}
{{- end -}}

{{/* preStop: wait for endpoints to drop the pod before SIGTERM starts the drain. */}}
{{- define "pdserve.lifecycle" -}}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .Values.shutdown.preStopSleepSeconds }}
{{- end -}}

{{/* Probes of a router (or the Ray head, which runs one): gRPC ones, or with TLS on (the
     kubelet's gRPC probes speak no TLS) HTTPS /health for startup and readiness and a TCP
     connect for liveness; pass (dict "root" $ "port" N "httpPort" H). */}}
{{- define "pdserve.frontProbes" -}}
{{- $p := .root.Values.probes -}}
{{- if .root.Values.tls.enabled -}}
startupProbe:
  httpGet: {path: /health, port: {{ .httpPort }}, scheme: HTTPS}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.startupFailureThreshold }}
livenessProbe:
  tcpSocket: {port: {{ .port }}}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
readinessProbe:
  httpGet: {path: /health, port: {{ .httpPort }}, scheme: HTTPS}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.readinessFailureThreshold }}
{{- else -}}
{{ include "pdserve.probes" . }}
{{- end -}}
{{- end -}}

{{/* Worker probes: gRPC, or with internalTLS (the kubelet's gRPC probes speak no TLS) HTTP on the
     metrics port: /health while the process serves, /ready while it takes work (503 draining).
     Pass (dict "root" $ "port" N "metricsPort" M). */}}
{{- define "pdserve.workerProbes" -}}
{{- $p := .root.Values.probes -}}
{{- if .root.Values.internalTLS.enabled -}}
startupProbe:
  httpGet: {path: /ready, port: {{ .metricsPort }}}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.startupFailureThreshold }}
livenessProbe:
  httpGet: {path: /health, port: {{ .metricsPort }}}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
readinessProbe:
  httpGet: {path: /ready, port: {{ .metricsPort }}}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.readinessFailureThreshold }}
{{- else -}}
{{ include "pdserve.probes" . }}
{{- end -}}
{{- end -}}

{{/* gRPC probes on grpc.health.v1; pass (dict "root" $ "port" N). */}}
{{- define "pdserve.probes" -}}
{{- $p := .root.Values.probes -}}
startupProbe:
  grpc: {port: {{ .port }}, service: ""}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.startupFailureThreshold }}
livenessProbe:
  grpc: {port: {{ .port }}, service: liveness}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
readinessProbe:
  grpc: {port: {{ .port }}, service: ""}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.readinessFailureThreshold }}
{{- end -}}

{{/* Model volume and mount (nothing for the bundled model). */}}
{{- define "pdserve.modelVolumes" -}}
{{- if eq .Values.model.source "pvc" -}}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "initContainer" -}}
- name: model
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "pdserve.modelMounts" -}}
{{- if ne .Values.model.source "bundled" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ eq .Values.model.source "pvc" }}
{{- end }}
{{- end -}}

{{- define "pdserve.initContainers" -}}
{{- if eq .Values.model.source "initContainer" -}}
initContainers:
  - name: fetch-model
    image: {{ .Values.model.initContainer.image }}
    command: {{ toJson .Values.model.initContainer.command }}
    env:
      - name: MODEL_DIR
        value: {{ .Values.model.mountPath }}/{{ .Values.model.subPath }}
      {{- with .Values.model.tokenSecret.name }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ . }}
            key: {{ $.Values.model.tokenSecret.key }}
      {{- end }}
    volumeMounts:
      - name: model
        mountPath: {{ .Values.model.mountPath }}
      {{- include "pdserve.tmpMount" . | nindent 6 }}
    {{- with .Values.securityContext }}
    securityContext: {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .Values.model.initContainer.resources }}
    resources: {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* Pod-level fields every pdserve pod shares. */}}
{{- define "pdserve.podCommon" -}}
serviceAccountName: {{ include "pdserve.serviceAccountName" . }}
{{- include "pdserve.podPullAndSecurity" . }}
{{- end -}}

{{/* Image pull secrets and pod securityContext (pods with a service account of their own). */}}
{{- define "pdserve.podPullAndSecurity" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Env and securityContext of a worker container (KV transfer side). */}}
{{- define "pdserve.workerEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- range $k, $v := .Values.kvTransfer.ucx }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{- define "pdserve.workerSecurityContext" -}}
{{- $sc := deepCopy .Values.securityContext -}}
{{- if .Values.kvTransfer.ipcLock -}}
{{- $caps := deepCopy ($sc.capabilities | default dict) -}}
{{- $_ := set $caps "add" (append ($caps.add | default list) "IPC_LOCK" | uniq) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end -}}
{{- with $sc -}}
securityContext: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Scheduling fields of a component block. */}}
{{- define "pdserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Flags of a standalone worker; pass (dict "root" $ "role" "prefill"). */}}
{{- define "pdserve.workerArgs" -}}
{{- $v := .root.Values -}}
{{- $w := index $v .role -}}
{{- include "pdserve.checkTensorParallel" (dict "root" .root "role" .role) -}}
- --tensor-parallel-size
- {{ $w.tensorParallelSize | quote }}
- --pipeline-parallel-size
- {{ $w.pipelineParallelSize | quote }}
- --host
- 0.0.0.0
- --port
- {{ $w.port | quote }}
- --advertise-host
- $(POD_IP)
- --kv-transfer-backend
- {{ $v.kvTransfer.backend }}
- --kv-transfer-host
- 0.0.0.0
- --kv-transfer-port
- {{ $w.kvTransferPort | quote }}
- --drain-timeout-s
- {{ $w.drainTimeoutSeconds | quote }}
- --metrics-port
- {{ $w.metricsPort | quote }}
- --redis-url
- $(PDSERVE_REDIS_URL)
{{- if eq .role "prefill" }}
- --lease-s
- {{ $w.leaseSeconds | quote }}
{{- else }}
- --lease-s
- {{ $v.prefill.leaseSeconds | quote }}
- --pull-timeout-s
- {{ $w.pullTimeoutSeconds | quote }}
{{- end }}
{{- range $w.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* NetworkPolicy peers: this release's pods of the given components; pass (dict "root" $ "components" list). */}}
{{- define "pdserve.peers" -}}
- podSelector: {{- include "pdserve.componentsSelector" . | nindent 4 }}
{{- end -}}

{{- define "pdserve.componentsSelector" -}}
matchLabels:
  app.kubernetes.io/name: {{ include "pdserve.name" .root }}
  app.kubernetes.io/instance: {{ .root.Release.Name }}
matchExpressions:
  - {key: app.kubernetes.io/component, operator: In, values: [{{ join ", " .components }}]}
{{- end -}}

{{/* The ports workers use between them: the KV transfer listener (+ networkPolicy.kvExtraPorts). */}}
{{- define "pdserve.kvPorts" -}}
- {port: kv-transfer}
{{- with .Values.networkPolicy.kvExtraPorts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Egress every pdserve pod needs: Redis, DNS, and networkPolicy.extraEgress. */}}
{{- define "pdserve.commonEgress" -}}
{{- if eq .Values.redis.mode "bundled" -}}
- to: {{- include "pdserve.peers" (dict "root" . "components" (list "redis")) | nindent 4 }}
  ports:
    - {port: 6379}
{{- else -}}
- ports:
    - {port: {{ include "pdserve.externalRedisPort" . }}}
  {{- with .Values.networkPolicy.externalRedisPeers }}
  to: {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
- ports:
    - {port: 53, protocol: UDP}
    - {port: 53, protocol: TCP}
{{- with .Values.networkPolicy.extraEgress }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The port of redis.external.url (6379 when it names none). */}}
{{- define "pdserve.externalRedisPort" -}}
{{- $hostport := regexReplaceAll "^rediss?://([^/]*).*$" .Values.redis.external.url "${1}" -}}
{{- if regexMatch ":[0-9]+$" $hostport -}}
{{- regexFind "[0-9]+$" $hostport -}}
{{- else -}}
6379
{{- end -}}
{{- end -}}

{{/* A CUDA worker of tensor-parallel size N and P pipeline stages needs N x P GPUs in its pod (one per rank);
     with ray.pipelineAcrossNodes (raycluster mode) each stage has a pod of its own: N GPUs in each. */}}
{{- define "pdserve.checkTensorParallel" -}}
{{- $w := index .root.Values .role -}}
{{- $gpus := int (index ($w.resources.limits | default dict) "nvidia.com/gpu" | default 0) -}}
{{- $across := include "pdserve.stagePods" . | int -}}
{{- $ranks := ternary (int $w.tensorParallelSize) (mul (int $w.tensorParallelSize) (int ($w.pipelineParallelSize | default 1))) (gt $across 1) -}}
{{- if and (eq .root.Values.model.device "cuda") (lt $gpus $ranks) -}}
{{- fail (printf "%s.tensorParallelSize=%d x pipelineParallelSize=%d needs %s.resources.limits nvidia.com/gpu >= %d (one GPU per rank), got %d" .role (int $w.tensorParallelSize) (int ($w.pipelineParallelSize | default 1)) .role $ranks $gpus) -}}
{{- end -}}
{{- end -}}

{{/* KV cache tiers of a pool (<role>.kvOffload): tier 2 in host memory, tier 3 an arena on local disk
     mounted at pdserve.kvOffloadDir. Each takes (dict "root" $ "role" "prefill"). */}}
{{- define "pdserve.kvOffloadDir" -}}
/var/cache/pdserve/kv
{{- end -}}

{{- define "pdserve.kvOffload" -}}
{{- toJson ((index .root.Values .role).kvOffload | default dict) -}}
{{- end -}}

{{/* Worker flags --kv-offload-*: none while cpuGiB is 0. */}}
{{- define "pdserve.kvOffloadArgs" -}}
{{- include "pdserve.checkKvOffload" . -}}
{{- $o := include "pdserve.kvOffload" . | fromJson -}}
{{- $d := $o.disk | default dict -}}
{{- if gt (float64 ($o.cpuGiB | default 0)) 0.0 }}
- --kv-offload-cpu-gib
- {{ $o.cpuGiB | quote }}
{{- if $d.enabled }}
- --kv-offload-dir
- {{ include "pdserve.kvOffloadDir" .root }}
- --kv-offload-disk-gib
- {{ $d.sizeGiB | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The disk tier's volume: an emptyDir (sizeLimit sizeGiB + 1Gi: the arena's header and block records
     come on top of its blocks, and a pod past its sizeLimit is evicted) or a hostPath directory. */}}
{{- define "pdserve.kvOffloadVolume" -}}
{{- $d := (include "pdserve.kvOffload" . | fromJson).disk | default dict -}}
{{- if $d.enabled }}
- name: kv-offload
  {{- if eq (($d.volume | default dict).type | default "emptyDir") "hostPath" }}
  hostPath:
    path: {{ $d.volume.hostPath }}
    type: Directory
  {{- else }}
  emptyDir:
    sizeLimit: {{ addf $d.sizeGiB 1 }}Gi
  {{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.kvOffloadMount" -}}
{{- $d := (include "pdserve.kvOffload" . | fromJson).disk | default dict -}}
{{- if $d.enabled }}
- {name: kv-offload, mountPath: {{ include "pdserve.kvOffloadDir" .root }}}
{{- end }}
{{- end -}}

{{/* The disk tier sits below the host tier and needs a size (and a path for hostPath); the host tier is
     part of the container's memory, so a limits.memory given in Gi must be larger than cpuGiB. */}}
{{- define "pdserve.checkKvOffload" -}}
{{- $w := index .root.Values .role -}}
{{- $o := include "pdserve.kvOffload" . | fromJson -}}
{{- $d := $o.disk | default dict -}}
{{- $cpu := float64 ($o.cpuGiB | default 0) -}}
{{- if $d.enabled -}}
{{- if le $cpu 0.0 -}}
{{- fail (printf "%s.kvOffload.disk.enabled needs %s.kvOffload.cpuGiB > 0 (the disk tier sits below the host-memory tier)" .role .role) -}}
{{- end -}}
{{- if le (float64 ($d.sizeGiB | default 0)) 0.0 -}}
{{- fail (printf "%s.kvOffload.disk.enabled needs %s.kvOffload.disk.sizeGiB > 0" .role .role) -}}
{{- end -}}
{{- if and (eq (($d.volume | default dict).type | default "emptyDir") "hostPath") (not $d.volume.hostPath) -}}
{{- fail (printf "%s.kvOffload.disk.volume.type=hostPath needs %s.kvOffload.disk.volume.hostPath (a directory on the node)" .role .role) -}}
{{- end -}}
{{- end -}}
{{- $mem := index ($w.resources.limits | default dict) "memory" | default "" | toString -}}
{{- if and (gt $cpu 0.0) (regexMatch "^[0-9]+(\\.[0-9]+)?Gi$" $mem) (le (float64 (trimSuffix "Gi" $mem)) $cpu) -}}
{{- fail (printf "%s.kvOffload.cpuGiB=%v lives in the container's memory: %s.resources.limits.memory (%s) must be larger" .role $o.cpuGiB .role $mem) -}}
{{- end -}}
{{- end -}}

{{/* raycluster mode: `pdserve serve` gives both pools one set of engine flags. */}}
{{- define "pdserve.checkRayKvOffload" -}}
{{- if ne (include "pdserve.kvOffloadArgs" (dict "root" . "role" "prefill")) (include "pdserve.kvOffloadArgs" (dict "root" . "role" "decode")) -}}
{{- fail "mode=raycluster: `pdserve serve` gives both pools the same engine flags, so prefill.kvOffload and decode.kvOffload must ask for the same tiers (cpuGiB, disk.enabled, disk.sizeGiB)" -}}
{{- end -}}
{{- end -}}

{{/* Pods one worker of a pool spans: its pipeline stages with ray.pipelineAcrossNodes in raycluster mode, else 1.
     Takes (dict "root" $ "role" "prefill"). */}}
{{- define "pdserve.stagePods" -}}
{{- $w := index .root.Values .role -}}
{{- if and .root.Values.ray.pipelineAcrossNodes (eq .root.Values.mode "raycluster") -}}
{{- $w.pipelineParallelSize | default 1 -}}
{{- else -}}
1
{{- end -}}
{{- end -}}

{{/* ray.pipelineAcrossNodes: only where Ray places the stages (raycluster mode), and not with the planner (which
     sizes the groups a pod per worker). */}}
{{- define "pdserve.checkPipelineAcrossNodes" -}}
{{- if .Values.ray.pipelineAcrossNodes -}}
{{- if ne .Values.mode "raycluster" -}}
{{- fail "ray.pipelineAcrossNodes needs mode=raycluster (Ray places one stage per pod)" -}}
{{- end -}}
{{- if .Values.planner.enabled -}}
{{- fail "ray.pipelineAcrossNodes is not supported with planner.enabled yet (the planner sizes a pod per worker)" -}}
{{- end -}}
{{- if and (gt (int (.Values.decode.pipelineParallelSize | default 1)) 1) (gt (int .Values.prefill.replicas) 0) -}}
{{- fail "ray.pipelineAcrossNodes: decode workers whose stages run on other pods cannot receive KV yet: decode.pipelineParallelSize must be 1" -}}
{{- end -}}
{{- end -}}
{{- end -}}
