{{/* Names and labels. */}}
{{- define "duet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "duet.fullname" -}}
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

{{- define "duet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "duet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "duet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "duet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "duet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "duet.redisName" -}}
{{- printf "%s-redis" (include "duet.fullname" .) }}
{{- end }}

{{- define "duet.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "duet.fullname" .)) }}
{{- end }}

{{- define "duet.apiKeysEnabled" -}}
{{- if or .Values.apiKeys.existingSecret .Values.apiKeys.keys }}true{{ end }}
{{- end }}

{{/*
The Ray custom resource of each duet node group a pod offers, in KubeRay's
rayStartParams form: a JSON object in single quotes (KubeRay puts the value after
`--resources=` in a shell command). Units per node: cluster/pools.py NODE_GROUP_UNITS.
*/}}
{{- define "duet.nodeGroupResources" -}}
{{- $resources := dict }}
{{- range . }}
{{- $_ := set $resources (printf "duet/%s" .) 1000 }}
{{- end }}
{{- printf "'%s'" (toJson $resources) }}
{{- end }}

{{/* Container resources of a Ray pod from {cpu, memory, gpu} (+ rdma): requests = limits. */}}
{{- define "duet.rayPodResources" -}}
{{- $r := .resources }}
{{- $amounts := dict "cpu" (toString (int $r.cpu)) "memory" $r.memory }}
{{- if gt (int ($r.gpu | default 0)) 0 }}
{{- $_ := set $amounts "nvidia.com/gpu" (toString (int $r.gpu)) }}
{{- end }}
{{- with .rdma }}
{{- if .enabled }}
{{- $_ := set $amounts .resourceName (toString (int (.count | default 1))) }}
{{- end }}
{{- end }}
{{- toYaml (dict "requests" $amounts "limits" $amounts) }}
{{- end }}

{{/*
`ray start` flags of a pod (dict: resources, nodeGroups, metricsPort, base, extra):
num-cpus/num-gpus from its resources, its node groups, Ray's metrics port, then
`base` (the head's own) and the user's `extra`, which wins.
*/}}
{{- define "duet.rayStartParams" -}}
{{- $p := dict "num-cpus" (toString (int .resources.cpu)) "metrics-export-port" (toString (int .metricsPort)) }}
{{- if gt (int (.resources.gpu | default 0)) 0 }}
{{- $_ := set $p "num-gpus" (toString (int .resources.gpu)) }}
{{- end }}
{{- if .nodeGroups }}
{{- $_ := set $p "resources" (include "duet.nodeGroupResources" .nodeGroups) }}
{{- end }}
{{- toYaml (merge (deepCopy (.extra | default dict)) (deepCopy (.base | default dict)) $p) }}
{{- end }}

{{/* A Ray pod's container env: the group's own (`env`), Serve's controller loop, and
what duet's config needs of every Ray process. `gateway.ingress: haproxy` is a Ray cluster setting: Serve reads
it in each process it starts. Args: dict "env" (the group's list) "root" (the chart). */}}
{{- define "duet.rayEnv" -}}
{{- $env := .env | default list -}}
{{- /* Serve's controller loop as `duet serve` runs it (cluster/app.py CONTROLLER_ENV), unless
the group's env sets it: the controller, on the head, reads it; no other process does */ -}}
{{- $loopSet := false -}}
{{- range $env }}{{ if eq .name "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" }}{{ $loopSet = true }}{{ end }}{{ end -}}
{{- if not $loopSet -}}
{{- $env = append $env (dict "name" "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" "value" "0.25") -}}
{{- end -}}
{{- if eq (dig "gateway" "ingress" "haproxy" .root.Values.duet) "haproxy" -}}
{{- $env = append $env (dict "name" "RAY_SERVE_ENABLE_HA_PROXY" "value" "1") -}}
{{- /* the drain `duet serve` sets too (cluster/serve_cli.py HAPROXY_DRAIN_S) */ -}}
{{- $env = append $env (dict "name" "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S" "value" "5") -}}
{{- /* the ingress request router reads the prompt (routing/router/ingress.py) */ -}}
{{- $env = append $env (dict "name" "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY" "value" "1") -}}
{{- end -}}
{{- with $env }}{{ toYaml . }}{{ end -}}
{{- end }}

{{/* The API-key Secret as a volume and its read-only mount (every Ray pod: the gateway may run on any). */}}
{{- define "duet.apiKeysVolume" -}}
{{- if include "duet.apiKeysEnabled" . -}}
- name: api-keys
  secret:
    secretName: {{ include "duet.apiKeysSecret" . }}
    items:
      - key: {{ .Values.apiKeys.existingSecretKey | default "keys" }}
        path: keys
{{- end }}
{{- end }}

{{- define "duet.apiKeysMount" -}}
{{- if include "duet.apiKeysEnabled" . -}}
- name: api-keys
  mountPath: /etc/duet/api-keys
  readOnly: true
{{- end }}
{{- end }}

{{/* Whether any pool deployed in this mode is scaled by the goodput policy (PoolAutoscaling's default policy). */}}
{{- define "duet.goodput" -}}
{{- $d := .Values.duet }}
{{- range (include "duet.pools" . | fromJsonArray) }}
{{- $a := dig "autoscaling" "" (get $d . | default dict) }}
{{- if and (kindIs "map" $a) (eq (dig "policy" "goodput" $a) "goodput") }}true{{ end }}
{{- end }}
{{- end }}

{{/* The pools of duet.mode (cluster/pools.py POOLS_BY_MODE), as a JSON list. */}}
{{- define "duet.pools" -}}
{{- if eq (.Values.duet.mode | default "disaggregated") "aggregated" }}["aggregated"]{{ else }}["prefill","decode"]{{ end }}
{{- end }}

{{/*
The Serve config (ServeDeploySchema) of the release, as cluster/serve_config.py
serve_config() builds it; tests/unit/test_helm_chart.py holds the two equal.
*/}}
{{- define "duet.serveConfig" -}}
{{- $gateway := .Values.duet.gateway | default dict }}
{{- /* A fixed pool's size goes to its deployment's num_replicas, not into args:
  Serve restarts every replica when args change, and only resizes for num_replicas. */}}
{{- $config := deepCopy .Values.duet }}
{{- $sizes := list }}
{{- range $name := (include "duet.pools" . | fromJsonArray) }}
{{- $pool := get $config $name | default dict }}
{{- $a := dig "autoscaling" "" $pool }}
{{- if not (and (kindIs "map" $a) (ne (dig "policy" "goodput" $a) "fixed")) }}
{{- $sizes = append $sizes (dict "name" $name "num_replicas" (int (get $pool "replicas" | default 1))) }}
{{- $_ := unset $pool "replicas" }}
{{- end }}
{{- end }}
{{- $app := dict
  "name" "duet"
  "route_prefix" "/"
  "import_path" "cluster.serve_config:build"
  "args" (dict "config" $config)
  "runtime_env" (dict "env_vars" (dict "PYTHONHASHSEED" "0" "HF_HUB_OFFLINE" "1" "TRANSFORMERS_VERBOSITY" "error" "LMCACHE_LOG_LEVEL" "WARNING" "RAY_worker_niceness" "0" "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD" "0" "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP" "0" "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS" "1000"))
  "logging_config" (dict "log_level" "WARNING" "enable_access_log" false) }}
{{- if $sizes }}
{{- $_ := set $app "deployments" $sizes }}
{{- end }}
{{- if include "duet.goodput" . }}
{{- $_ := set $app "autoscaling_policy" (dict "policy_function" "cluster.autoscaler:GoodputAutoscaler" "policy_kwargs" (dict "config" $config)) }}
{{- end }}
{{- $http := dict "host" (get $gateway "host" | default "127.0.0.1") "port" (int (get $gateway "port" | default 8000)) }}
{{- toYaml (dict "http_options" $http "applications" (list $app)) }}
{{- end }}

{{/*
What the schema cannot say: the checks that span sections. Each failure names the
value to change.
*/}}
{{- define "duet.checks" -}}
{{- $d := .Values.duet }}
{{- $gw := $d.gateway | default dict }}
{{- $groups := concat (.Values.head.nodeGroups | default list) (keys (.Values.workerGroups | default dict) | sortAlpha) }}
{{- $offered := printf "head.nodeGroups and workerGroups offer: %s" (join ", " $groups | default "none") }}
{{- range $name := (include "duet.pools" . | fromJsonArray) }}
{{- $pool := get $d $name | default dict }}
{{- if and $pool.node_group (not (has $pool.node_group $groups)) }}
{{- fail (printf "duet.%s.node_group: %q is not a node group of this release (%s)" $name $pool.node_group $offered) }}
{{- end }}
{{- if kindIs "string" (dig "autoscaling" "profile" nil $pool) }}
{{- fail (printf "duet.%s.autoscaling.profile: %q is a file path; a release carries the profile inline ({prefill_model: {...}, decode_model: {...}}): no pod has the file" $name $pool.autoscaling.profile) }}
{{- end }}
{{- end }}
{{- if not (has ($gw.host | default "127.0.0.1") (list "0.0.0.0" "::")) }}
{{- fail (printf "duet.gateway.host: %q; set 0.0.0.0 so that the gateway Service reaches the ingress (HAProxy) on the Ray pods" ($gw.host | default "127.0.0.1")) }}
{{- end }}
{{- range $name, $g := .Values.workerGroups }}
{{- $min := ternary $g.minReplicas $g.replicas (hasKey $g "minReplicas") }}
{{- $max := ternary $g.maxReplicas $g.replicas (hasKey $g "maxReplicas") }}
{{- if gt (int $min) (int $g.replicas) }}
{{- fail (printf "workerGroups.%s.minReplicas: %d is above replicas (%d)" $name (int $min) (int $g.replicas)) }}
{{- end }}
{{- if lt (int $max) (int $g.replicas) }}
{{- fail (printf "workerGroups.%s.maxReplicas: %d is below replicas (%d)" $name (int $max) (int $g.replicas)) }}
{{- end }}
{{- end }}
{{- if and .Values.redis.enabled .Values.redis.externalUrl }}
{{- fail "redis.externalUrl: set while redis.enabled is true; use one or the other" }}
{{- end }}
{{- $redis := .Values.redis.externalUrl }}
{{- if .Values.redis.enabled }}
{{- $redis = printf "redis://%s:6379" (include "duet.redisName" .) }}
{{- end }}
{{- if $redis }}
{{- $router := $d.router | default dict }}
{{- $urls := dict }}
{{- if eq ($router.prefix_index | default "memory") "redis" }}
{{- $_ := set $urls "router" ($router.redis_url | default "redis://127.0.0.1:6390/0") }}
{{- end }}
{{- with (dig "cache" "redis_url" "" $d) }}
{{- $_ := set $urls "cache" . }}
{{- end }}
{{- range $section, $url := $urls }}
{{- if not (hasPrefix (printf "%s/" $redis) (printf "%s/" $url)) }}
{{- fail (printf "duet.%s.redis_url: %q is not this release's Redis; use %s/<db>" $section $url $redis) }}
{{- end }}
{{- end }}
{{- end }}
{{- $keysFile := $gw.api_keys_file | default "" }}
{{- if include "duet.apiKeysEnabled" . }}
{{- if ne $keysFile "/etc/duet/api-keys/keys" }}
{{- fail (printf "duet.gateway.api_keys_file: %q; with apiKeys set it must be /etc/duet/api-keys/keys (else the gateway never reads them and stays open)" $keysFile) }}
{{- end }}
{{- else if hasPrefix "/etc/duet/api-keys/" $keysFile }}
{{- fail (printf "duet.gateway.api_keys_file: %q, but apiKeys has no keys and no existingSecret: nothing is mounted there" $keysFile) }}
{{- end }}
{{- end }}
