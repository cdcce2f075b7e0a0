{{/* Names and labels, as `helm create` spells them. */}}
{{- define "outbox-relay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "outbox-relay.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "outbox-relay.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "outbox-relay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outbox-relay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "outbox-relay.labels" -}}
helm.sh/chart: {{ include "outbox-relay.chart" . }}
{{ include "outbox-relay.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: relay
{{- end }}

{{- define "outbox-relay.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "outbox-relay.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The Secret the relay's environment comes from: the user's existingSecret, or
one named after the release, which the user creates or, with secrets.create,
the chart does.
*/}}
{{- define "outbox-relay.secretName" -}}
{{- $s := .Values.secrets }}
{{- if and $s.create $s.existingSecret }}
{{- fail "secrets.create and secrets.existingSecret are exclusive: either the chart creates the Secret or you name yours" }}
{{- end }}
{{- default (include "outbox-relay.fullname" .) $s.existingSecret }}
{{- end }}

{{/* The relay's configuration file: values.config with http.listen set to the probed port. */}}
{{- define "outbox-relay.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $http := default (dict) (get $cfg "http") }}
{{- $listen := printf "0.0.0.0:%v" .Values.containerPort }}
{{- if and (hasKey $http "listen") (ne (toString (get $http "listen")) $listen) }}
{{- fail (printf "config.http.listen is set by the chart to %s (the probes and the Service use containerPort): remove it, or change containerPort" $listen) }}
{{- end }}
{{- $_ := set $http "listen" $listen }}
{{- $_ := set $cfg "http" $http }}
{{- toYaml $cfg }}
{{- end }}
