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

{{/* Where a pool's replicas are found, as the policy says it: the headless Service's DNS name
(the chart's, or with `existing` the team's own Service, or the chart's over the team's pods), or
`existing.urls`. */}}
{{- define "llm.poolReplicas" -}}
{{- $existing := .pool.existing | default dict -}}
{{- $given := pick $existing "service" "selector" "urls" | keys -}}
{{- if and .pool.existing (ne (len $given) 1) -}}
{{- fail (printf "pools.%s.existing: give one of service (a headless Service), selector (pods the chart's headless Service selects) or urls" .name) -}}
{{- end -}}
{{- if $existing.urls -}}
{{- dict "replicas" $existing.urls | toYaml -}}
{{- else -}}
{{- $service := $existing.service | default (include "llm.poolService" .) -}}
{{- $namespace := $existing.namespace | default .root.Release.Namespace -}}
{{- $name := printf "%s.%s.svc.cluster.local:%v" $service $namespace (include "llm.poolPort" .) -}}
{{- if $existing.scheme -}}
{{- dict "dns" (dict "name" $name "scheme" $existing.scheme) | toYaml -}}
{{- else -}}
{{- dict "dns" $name | toYaml -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* The port a pool's replicas serve on: the team's (`existing.port`) or the chart's vLLM's. */}}
{{- define "llm.poolPort" -}}
{{- (.pool.existing | default dict).port | default .root.Values.vllm.port -}}
{{- end }}

{{/* Where a `tls.secretName` Secret is mounted: a directory, so that its renewals reach the pod. */}}
{{- define "llm.tlsDir" -}}
/etc/llm-gateway-tls
{{- end }}

{{/* The policy the gateway runs: the values' `policy`, each pool's replicas (`llm.poolReplicas`),
the listener's certificate from `tls.secretName`, and the shared state in the chart's Redis for
`gateway.replicas` gateways. */}}
{{- define "llm.policy" -}}
{{- $policy := deepCopy .Values.policy -}}
{{- $pools := dict -}}
{{- range $name, $pool := .Values.pools -}}
{{- if $pool -}}
{{- $replicas := include "llm.poolReplicas" (dict "name" $name "pool" $pool "root" $) | fromYaml -}}
{{- $_ := set $pools $name (merge $replicas (deepCopy $pool.policy)) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $policy "pools" $pools -}}
{{- if .Values.tls.secretName -}}
{{- $dir := include "llm.tlsDir" . -}}
{{- $tls := dict "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir) -}}
{{- $_ := set $policy "server" (merge (dict "tls" $tls) (deepCopy ($policy.server | default dict))) -}}
{{- end -}}
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

{{/* `gateway.workers`, or unset the pod's CPU request rounded up (`2`, `1500m`: 2; none: 1);
refused where the pod cannot share its caps and quotas across them: more than one needs the
chart's Redis, or, without it, a `policy.state` naming a shared backend. */}}
{{- define "llm.workers" -}}
{{- $cpu := toString ((.Values.gateway.resources.requests | default dict).cpu | default "1") -}}
{{- $requested := ternary (divf (trimSuffix "m" $cpu | float64) 1000) ($cpu | float64) (hasSuffix "m" $cpu) | ceil | int -}}
{{- $workers := int (.Values.gateway.workers | default $requested) -}}
{{- $backend := ternary "redis" ((.Values.policy.state | default dict).backend | default "memory") .Values.redis.enabled -}}
{{- if lt $workers 1 -}}
{{- fail "gateway.workers must be at least 1" -}}
{{- end -}}
{{- if and (gt $workers 1) (eq $backend "memory") -}}
{{- fail (printf "gateway.workers: %d needs shared state (redis.enabled, or state.backend: redis): with state.backend memory every worker would keep its own caps and quotas" $workers) -}}
{{- end -}}
{{- $workers -}}
{{- end }}
