{{/*
Names, labels and the few computed values every template shares. Everything here is plain Helm (Go
templates with Sprig); the suite renders the chart with Helm's own engine (tests/infra/test_helm.py).
*/}}

{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select one component's pods: Services, NetworkPolicies and spread constraints use these. */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ include "tandem.version" .root | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* The one version of every Tandem image. */}}
{{- define "tandem.version" -}}
{{- .Values.image.version | default .Chart.AppVersion -}}
{{- end -}}

{{/* The engine image of prefill AND decode nodes: one definition, so the two roles cannot differ. */}}
{{- define "tandem.nodeImage" -}}
{{- if not (has .Values.image.variant (list "cpu" "gpu")) -}}
{{- fail (printf "image.variant must be cpu or gpu, not %q" .Values.image.variant) -}}
{{- end -}}
{{- printf "%s:%s-%s" .Values.image.repository (include "tandem.version" .) .Values.image.variant -}}
{{- end -}}

{{/* Router and lake writer: no engine, so the CPU build of the same version. */}}
{{- define "tandem.serviceImage" -}}
{{- printf "%s:%s-cpu" .Values.image.repository (include "tandem.version" .) -}}
{{- end -}}

{{- define "tandem.clusterSecretName" -}}
{{- .Values.clusterSecret.existingSecret | default (printf "%s-cluster" (include "tandem.fullname" .)) -}}
{{- end -}}

{{- define "tandem.redisSecretName" -}}
{{- if and (not .Values.redis.bundled) .Values.redis.existingSecret -}}
{{- .Values.redis.existingSecret -}}
{{- else -}}
{{- printf "%s-redis" (include "tandem.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "tandem.databaseSecretName" -}}
{{- if and (not .Values.postgresql.bundled) .Values.postgresql.existingSecret -}}
{{- .Values.postgresql.existingSecret -}}
{{- else -}}
{{- printf "%s-postgresql" (include "tandem.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
A secret value that survives upgrades: the value given, else the one already in the cluster (lookup),
else a fresh random one. `helm template` has no cluster, so it always generates.
args: root, secret (name), key, given
*/}}
{{- define "tandem.secretValue" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .secret -}}
{{- if .given -}}
{{- .given -}}
{{- else if and $existing (index ($existing.data | default dict) .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
{{- end -}}

{{/* Environment every Tandem process has: the one Redis URL, and a writable HOME (the pods run as a user
the image need not know; vLLM, torch and Hugging Face cache under it). */}}
{{- define "tandem.redisEnv" -}}
- name: HOME
  value: /tmp
- name: TANDEM_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.redisSecretName" . }}
      key: redis-url
{{- end -}}

{{/* ... and for the processes on the KV wire (nodes, routers), the cluster secret. */}}
{{/* The cluster name every process reads (TANDEM_CLUSTER): the release's, so two releases on one Redis
use different keys. contracts/cluster.py's pattern: 1-40 lower-case letters, digits and dashes. */}}
{{- define "tandem.clusterName" -}}
{{- $name := .Values.clusterName | default (include "tandem.fullname" .) -}}
{{- if not (regexMatch "^[a-z0-9][a-z0-9-]{0,39}$" $name) -}}
{{- fail (printf "clusterName %q: use 1-40 lower-case letters, digits or dashes" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "tandem.clusterEnv" -}}
- name: TANDEM_CLUSTER
  value: {{ include "tandem.clusterName" . | quote }}
{{- end -}}

{{/* The telemetry streams' prefix, as contracts.cluster.key(name, "telemetry") makes it for the routers. */}}
{{- define "tandem.telemetryPrefix" -}}
{{- $name := include "tandem.clusterName" . -}}
{{- if eq $name "default" -}}tandem:telemetry{{- else -}}{{ printf "tandem:%s:telemetry" $name }}{{- end -}}
{{- end -}}

{{- define "tandem.commonEnv" -}}
{{ include "tandem.redisEnv" . }}
{{ include "tandem.clusterEnv" . }}
- name: TANDEM_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.clusterSecretName" . }}
      key: cluster-secret
{{- end -}}

{{- define "tandem.extraEnv" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}
