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

{{/* The gateway's image: the release the chart came with (its appVersion) unless `tag` says
otherwise, from `registry` (the release workflow's IMAGE_REGISTRY, or a mirror of it). */}}
{{- define "llm.gatewayImage" -}}
{{- $image := .Values.gateway.image -}}
{{- with $image.registry }}{{ trimSuffix "/" . }}/{{ end -}}
{{- $image.repository }}:{{ $image.tag | default .Chart.AppVersion -}}
{{- end }}

{{/* `tokenizerSource`, checked: its type is one the chart knows and what that type needs is set. */}}
{{- define "llm.tokenizerSource" -}}
{{- $source := .Values.tokenizerSource -}}
{{- if not (has $source.type (list "hub" "pvc" "image" "imageVolume")) -}}
{{- fail (printf "tokenizerSource.type is %q: one of hub, pvc, image, imageVolume" $source.type) -}}
{{- end -}}
{{- if eq $source.type "pvc" -}}
{{- $_ := required "tokenizerSource.type pvc needs tokenizerSource.pvc.claimName" $source.pvc.claimName -}}
{{- end -}}
{{- if has $source.type (list "image" "imageVolume") -}}
{{- $_ := required (printf "tokenizerSource.type %s needs tokenizerSource.image.reference" $source.type) $source.image.reference -}}
{{- end -}}
{{- $source.type -}}
{{- end }}
