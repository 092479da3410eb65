{{/* Names and labels, the conventions `helm create` uses. */}}
{{- define "colibri.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "colibri.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "colibri.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "colibri.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "colibri.selectorLabels" -}}
app.kubernetes.io/name: {{ include "colibri.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "colibri.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "colibri.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: inference
{{- end }}

{{- define "colibri.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "colibri.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "colibri.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}

{{/*
Triton's queue time per request over this release's pods, in microseconds: what the autoscaler
holds at autoscaling.targetQueueMicroseconds. 0 without traffic (a ratio of zero rates is NaN).
*/}}
{{- define "colibri.queueQuery" -}}
{{- $sel := printf "namespace=\"%s\",service=\"%s\",model=\"colibri_moe\"" .Release.Namespace (include "colibri.fullname" .) -}}
{{- $w := .Values.autoscaling.window -}}
(sum(rate(nv_inference_queue_duration_us{ {{- $sel -}} }[{{ $w }}])) / (sum(rate(nv_inference_request_success{ {{- $sel -}} }[{{ $w }}])) > 0)) or vector(0)
{{- end }}

{{/* What /weights holds to serve: weights.folder (a whole model's layer files) or weights.file. */}}
{{- define "colibri.weightsPath" -}}
/weights/{{ .Values.weights.folder | default .Values.weights.file }}
{{- end }}

{{/* The settings that contradict each other, refused in one line each. */}}
{{- define "colibri.validate" -}}
{{- $w := .Values.weights -}}
{{- if and $w.demo $w.existingClaim }}
{{- fail (printf "weights.demo writes random weights into an emptyDir: set weights.existingClaim to \"\" (it is %q) or weights.demo to false" $w.existingClaim) }}
{{- end }}
{{- if and $w.demo $w.fetch.enabled }}
{{- fail "weights.demo and weights.fetch.enabled both give the checkpoint: keep one" }}
{{- end }}
{{- if and (not $w.demo) (not $w.existingClaim) (not $w.fetch.enabled) }}
{{- fail "weights: no checkpoint source: set weights.existingClaim (a PVC holding the packed file), weights.fetch.enabled with an image and command, or weights.demo=true (random weights)" }}
{{- end }}
{{- if and $w.fetch.enabled (or (not $w.fetch.image) (not $w.fetch.command)) }}
{{- fail "weights.fetch.enabled needs weights.fetch.image and weights.fetch.command (examples: docs/kubernetes.md)" }}
{{- end }}
{{- if and $w.pack.enabled (not $w.fetch.enabled) }}
{{- fail "weights.pack.enabled converts what weights.fetch wrote to /staging: enable weights.fetch too" }}
{{- end }}
{{- if and $w.folder $w.demo }}
{{- fail (printf "weights.folder (%q) is a whole model's layers; weights.demo writes one random file: keep one" $w.folder) }}
{{- end }}
{{- if not (hasSuffix ".colibri.safetensors" $w.file) }}
{{- fail (printf "weights.file must end in .colibri.safetensors (what colibri pack writes), got %q" $w.file) }}
{{- end }}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- fail (printf "autoscaling.minReplicas (%v) is above autoscaling.maxReplicas (%v)" .Values.autoscaling.minReplicas .Values.autoscaling.maxReplicas) }}
{{- end }}
{{- end }}
