{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "mooncake-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects: <release>-<chart> unless the release name already holds the chart's. */}}
{{- define "mooncake-operator.fullname" -}}
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

{{- define "mooncake-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "mooncake-operator.labels" -}}
helm.sh/chart: {{ include "mooncake-operator.chart" . }}
{{ include "mooncake-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The operator pod's selector: immutable on the Deployment, so only labels that never change. */}}
{{- define "mooncake-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mooncake-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "mooncake-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mooncake-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: repository:tag, or repository@digest when image.digest is set (a digest pins the
content; the tag would be ignored by the runtime, so it is left out). A repository that already carries a
digest is refused, naming the two values to set instead. */}}
{{- define "mooncake-operator.image" -}}
{{- $image := .Values.image }}
{{- if contains "@" $image.repository }}
{{- fail (printf "image.repository %q carries a digest: set image.repository=%s and image.digest=%s" $image.repository (regexReplaceAll "@.*$" $image.repository "") (regexReplaceAll "^[^@]*@" $image.repository "")) }}
{{- end }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/* Base of every alert's runbook_url: the value, or this release's published runbooks. */}}
{{- define "mooncake-operator.runbookBaseUrl" -}}
{{- default (printf "https://mooncake-operator.dev/docs/v%s/runbooks" .Chart.AppVersion) .Values.monitoring.prometheusRule.runbookBaseUrl | trimSuffix "/" }}
{{- end }}

{{/* The leader-election Lease: one per release, so a second release in the same namespace (watching
other namespaces) leads its own instead of idling behind the first. */}}
{{- define "mooncake-operator.leaseName" -}}
{{- include "mooncake-operator.fullname" . }}
{{- end }}

{{/* Namespace of the MooncakeServing that `helm test` proves. */}}
{{- define "mooncake-operator.testNamespace" -}}
{{- default .Release.Namespace .Values.test.servingNamespace }}
{{- end }}

{{/* ServiceAccount (and Role, RoleBinding) of the `helm test` Pod. */}}
{{- define "mooncake-operator.testServiceAccountName" -}}
{{- printf "%s-canary" (include "mooncake-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
