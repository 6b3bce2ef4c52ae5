{{/* Names: "<release>-splitserve" unless the release name already says splitserve; trimmed so that
     "<fullname>-prefill" and friends stay within Kubernetes' 63 characters. */}}
{{- define "splitserve.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "splitserve.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels that select one component's pods. Call with (dict "root" $ "component" "prefill"). The router's
     discovery selectors are built from the same labels (splitserve.discoverySelector). */}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/part-of: splitserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The router's label selector for one worker role, as `key=value` words. */}}
{{- define "splitserve.discoverySelector" -}}
- app.kubernetes.io/name={{ include "splitserve.name" .root }}
- app.kubernetes.io/instance={{ .root.Release.Name }}
- app.kubernetes.io/component={{ .component }}
{{- end -}}

{{- define "splitserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (printf "%s-router" (include "splitserve.fullname" .)) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.apiKeySecret" -}}
{{- .Values.router.apiKey.existingSecret | default (printf "%s-api-key" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{- define "splitserve.clusterTokenSecret" -}}
{{- .Values.transfer.clusterToken.existingSecret | default (printf "%s-cluster-token" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{- define "splitserve.workerApiKeySecret" -}}
{{- .Values.workerApiKey.existingSecret | default (printf "%s-worker-key" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{/* A Secret holding one random value under `key`, made once and kept across upgrades (read back with lookup).
     Arguments: root, name, key, component. */}}
{{- define "splitserve.randomSecret" -}}
{{- $old := lookup "v1" "Secret" .root.Release.Namespace .name }}
---
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  labels: {{- include "splitserve.labels" (dict "root" .root "component" .component) | nindent 4 }}
type: Opaque
data:
  {{- if and $old $old.data (index $old.data .key) }}
  {{ .key }}: {{ index $old.data .key }}
  {{- else }}
  {{ .key }}: {{ randAlphaNum 32 | b64enc }}
  {{- end }}
{{- end -}}

{{- define "splitserve.apiKeyEnabled" -}}
{{- if or .Values.router.apiKey.existingSecret .Values.router.apiKey.value -}}true{{- end -}}
{{- end -}}

{{- define "splitserve.modelClaim" -}}
{{- .Values.model.pvc.claimName | default (printf "%s-model" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{/* The --model-path flag (nothing for the default model, "tiny" for the built-in tiny model). */}}
{{- define "splitserve.modelArgs" -}}
{{- if eq .Values.model.source "tiny" }}
- --model-path=tiny
{{- else if ne .Values.model.source "builtin" }}
- --model-path={{ trimSuffix "/" .Values.model.mountPath }}/{{ required "model.path is required unless model.source is builtin or tiny" .Values.model.path }}
{{- end }}
{{- with .Values.model.servedModelName }}
- --served-model-name={{ . }}
{{- end }}
{{- end -}}

{{/* The model volume, by model.source. */}}
{{- define "splitserve.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ include "splitserve.modelClaim" . }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "init" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.init.sizeLimit }}
{{- end }}
{{- end -}}

{{/* The init container that fetches the model (model.source: init). */}}
{{- define "splitserve.modelInit" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "init" }}
- name: fetch-model
  image: {{ required "model.init.image is required when model.source is init" $m.init.image }}
  command: {{- required "model.init.command is required when model.source is init" $m.init.command | toYaml | nindent 4 }}
  env:
    - name: MODEL_DIR
      value: {{ trimSuffix "/" $m.mountPath }}/{{ required "model.path is required unless model.source is builtin or tiny" $m.path }}
    {{- with $m.init.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $m.init.resources }}
  resources: {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
{{- end }}
{{- end -}}
