{{/* The labels every object carries. */}}
{{- define "llm.labels" -}}
app.kubernetes.io/part-of: llm-admission-gateway
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}

{{/* A pool's vLLM Deployment and headless Service name. */}}
{{- define "llm.poolService" -}}
{{- .pool.service | default (printf "vllm-%s" .name) -}}
{{- end }}

{{/* The policy the gateway runs: the values' `policy`, each pool found through its headless
Service's DNS name, and the shared state in the chart's Redis for `gateway.replicas` gateways. */}}
{{- define "llm.policy" -}}
{{- $policy := deepCopy .Values.policy -}}
{{- $pools := dict -}}
{{- range $name, $pool := .Values.pools -}}
{{- if $pool -}}
{{- $service := include "llm.poolService" (dict "name" $name "pool" $pool) -}}
{{- $dns := printf "%s.%s.svc.cluster.local:%v" $service $.Release.Namespace $.Values.vllm.port -}}
{{- $_ := set $pools $name (merge (dict "dns" $dns) (deepCopy $pool.policy)) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $policy "pools" $pools -}}
{{- if .Values.redis.enabled -}}
{{- $url := printf "redis://redis.%s.svc.cluster.local:6379/0" .Release.Namespace -}}
{{- $state := merge (dict "backend" "redis" "url" $url "gateways" (int .Values.gateway.replicas)) (deepCopy (.Values.state | default dict)) -}}
{{- $_ := set $policy "state" $state -}}
{{- end -}}
{{- toYaml $policy -}}
{{- end }}
