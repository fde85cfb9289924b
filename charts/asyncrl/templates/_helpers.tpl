{{/* Names and labels shared by every template. */}}

{{- define "asyncrl.fullname" -}}
{{- printf "%s-asyncrl-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "asyncrl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "asyncrl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "asyncrl.selectorLabels" -}}
app.kubernetes.io/name: asyncrl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "asyncrl.labels" -}}
{{ include "asyncrl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "asyncrl.image" -}}
{{- printf "%s:%s" .repository (default $.appVersion .tag) -}}
{{- end -}}
