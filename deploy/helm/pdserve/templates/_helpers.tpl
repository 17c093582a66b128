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

{{/* Env entries giving $(PDSERVE_REDIS_URL), with the password from its Secret (never in values). */}}
{{- define "pdserve.redisEnv" -}}
{{- if eq .Values.redis.mode "bundled" -}}
- name: PDSERVE_REDIS_URL
  value: redis://{{ include "pdserve.redisHost" . }}:6379/0
{{- else if .Values.redis.external.passwordSecret.name -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.passwordSecret.name }}
      key: {{ .Values.redis.external.passwordSecret.key }}
- name: PDSERVE_REDIS_URL
  value: {{ regexReplaceAll "^(rediss?://)" .Values.redis.external.url "${1}:$(REDIS_PASSWORD)@" | quote }}
{{- else -}}
- name: PDSERVE_REDIS_URL
  value: {{ .Values.redis.external.url | quote }}
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
{{- with .Values.model.maxModelLen }}
- --max-model-len
- {{ . | quote }}
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
    {{- with .Values.model.initContainer.resources }}
    resources: {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* Pod-level fields every pdserve pod shares. */}}
{{- define "pdserve.podCommon" -}}
serviceAccountName: {{ include "pdserve.serviceAccountName" . }}
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
{{- $_ := set $sc "capabilities" (dict "add" (list "IPC_LOCK")) -}}
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
