{{/* Names and labels. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* KubeRay derives pod and Service names from the RayService name: keep it short. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{/* The label of every pod running a gateway replica (the head, the gateway group): the
HTTP and gRPC Services select it. */}}
{{- define "tandem.gatewayLabel" -}}
tandem.dev/gateway: "true"
{{- end }}

{{/* Selector of one component's pods: (dict "ctx" $ "component" "head") */}}
{{- define "tandem.componentSelector" -}}
{{ include "tandem.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The Redis URL Tandem's router uses, or "" for the gateway's in-process index. */}}
{{- define "tandem.redisUrl" -}}
{{- if .Values.redis.externalUrl }}
{{- .Values.redis.externalUrl }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s-redis.%s.svc:6379/0" (include "tandem.fullname" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{/* The Redis (host:port) the Ray head keeps the cluster's state in under GCS fault tolerance:
rayService.gcsFaultTolerance.redisAddress, else the release's Redis, else redis.externalUrl's
host:port when that is a plain redis:// URL without credentials. */}}
{{- define "tandem.gcsRedisAddress" -}}
{{- $ft := .Values.rayService.gcsFaultTolerance }}
{{- if $ft.redisAddress }}
{{- $ft.redisAddress }}
{{- else if include "tandem.deployRedis" . }}
{{- printf "%s-redis.%s.svc:6379" (include "tandem.fullname" .) .Release.Namespace }}
{{- else if .Values.redis.externalUrl }}
{{- $url := urlParse .Values.redis.externalUrl }}
{{- if or (ne $url.scheme "redis") $url.userinfo }}
{{- fail (printf "rayService.gcsFaultTolerance: the Ray head's Redis cannot be taken from redis.externalUrl (%s://...: Ray's GCS takes a plain host:port, with the password from a Secret); set rayService.gcsFaultTolerance.redisAddress (and redisPasswordSecret), or rayService.gcsFaultTolerance.enabled=false" $url.scheme) }}
{{- end }}
{{- if contains ":" $url.host }}{{ $url.host }}{{ else }}{{ printf "%s:6379" $url.host }}{{ end }}
{{- else }}
{{- fail "rayService.gcsFaultTolerance: no Redis to keep the Ray head's state in; set redis.enabled=true, rayService.gcsFaultTolerance.redisAddress, or rayService.gcsFaultTolerance.enabled=false" }}
{{- end }}
{{- end }}

{{- define "tandem.deployRedis" -}}
{{- if and .Values.redis.enabled (not .Values.redis.externalUrl) }}true{{ end }}
{{- end }}

{{/* Whether the Prometheus operator's objects are rendered. */}}
{{- define "tandem.prometheusOperator" -}}
{{- if or .Values.monitoring.forcePrometheusOperator (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") }}true{{ end }}
{{- end }}

{{/* Model path inside the pods, or nothing for the built-in model. */}}
{{- define "tandem.modelPath" -}}
{{- if .Values.model.path }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.path) }}
{{- end }}
{{- end }}

{{/* The app's `model` setting: the hub id (read from the hub cache the init containers fill),
the model's path inside the pods, or nothing for the built-in model. */}}
{{- define "tandem.model" -}}
{{- .Values.model.hubId | default (include "tandem.modelPath" .) }}
{{- end }}

{{/* Where model.hubCache is mounted in every Ray pod: HF_HOME. */}}
{{- define "tandem.hubHome" -}}
/hf
{{- end }}

{{/*
Refusals: a model from two places, a token with no hub id, a hub cache of several volume
sources, and with model.hubId the Hugging Face variables the chart sets in extraEnv.
*/}}
{{- define "tandem.modelChecks" -}}
{{- $m := .Values.model }}
{{- if and $m.hubId $m.path }}
{{- fail "model: set either model.path (a model on model.volume) or model.hubId (a Hugging Face id fetched by an init container), not both" }}
{{- end }}
{{- if and $m.hubTokenSecret (not $m.hubId) }}
{{- fail "model.hubTokenSecret is the token for model.hubId: set model.hubId, or remove model.hubTokenSecret" }}
{{- end }}
{{- if $m.hubId }}
{{- $cache := $m.hubCache | default dict }}
{{- if ne (len $cache) 1 }}
{{- fail (printf "model.hubCache: give one volume source, got [%s] (Helm merges your values into the default: set emptyDir: null beside your source)" (keys $cache | sortAlpha | join ", ")) }}
{{- end }}
{{- $lists := dict "extraEnv" .Values.extraEnv "head.extraEnv" .Values.head.extraEnv "prefill.extraEnv" .Values.prefill.extraEnv "decode.extraEnv" .Values.decode.extraEnv }}
{{- range $where, $list := $lists }}
{{- range $list }}
{{- if has .name (list "HF_HOME" "HF_HUB_CACHE" "HF_HUB_OFFLINE" "HF_TOKEN") }}
{{- fail (printf "%s: %s is set by the chart with model.hubId: remove it (a token: model.hubTokenSecret)" $where .name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The init container of every Ray pod with model.hubId: `tandem fetch` downloads the model into
the hub cache (HF_HOME on model.hubCache), with HF_TOKEN from model.hubTokenSecret's Secret when
set (a secretKeyRef: the token itself is never in the manifest). The pod's extraEnv too
(proxies, HF_ENDPOINT). (dict "ctx" $ "extra" list); nothing without model.hubId.
*/}}
{{- define "tandem.fetchModelContainer" -}}
{{- $ctx := .ctx }}
{{- with $ctx.Values.model.hubId -}}
- name: fetch-model
  image: {{ include "tandem.image" $ctx }}
  imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
  command: ["tandem", "fetch", {{ . | quote }}]
  securityContext:
    {{- toYaml $ctx.Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml $ctx.Values.model.fetchResources | nindent 4 }}
  env:
    - name: HF_HOME
      value: {{ include "tandem.hubHome" $ctx }}
    {{- with $ctx.Values.model.hubTokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ .name }}
          key: {{ .key }}
    {{- end }}
    {{- with $.extra }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  volumeMounts:
    - name: hf-cache
      mountPath: {{ include "tandem.hubHome" $ctx }}
    - name: tmp
      mountPath: /tmp
    - name: home
      mountPath: /home/ray
{{- end }}
{{- end }}

{{/* Ray custom resource that pins each deployment to its group, one replica per pod. */}}
{{- define "tandem.rayResource" -}}
tandem_{{ . }}
{{- end }}

{{/*
The Serve application: tandem.services.app:app_builder with AppConfig settings as args, exactly the
settings `tandem up --config` reads from its YAML file.
*/}}
{{- define "tandem.appArgs" -}}
{{- $args := deepCopy .Values.app }}
{{- $_ := set $args "model" (include "tandem.model" . | default nil) }}
{{- $_ = set $args "host" "0.0.0.0" }}
{{- $_ = set $args "port" .Values.ports.http }}
{{- $_ = set $args "grpc_port" .Values.ports.grpc }}
{{- /* A wildcard worker host listens on, and advertises, the pod's own IP. */}}
{{- $_ = set $args "worker_host" "0.0.0.0" }}
{{- $_ = set $args "redis_url" (include "tandem.redisUrl" . | default nil) }}
{{- $_ = set $args "colocated" false }}
{{- /* The RayService is the cluster; each role on its group's pods (the Ray resources the
groups declare, which the deployments below also ask for). */}}
{{- $_ = set $args "ray_address" nil }}
{{- range $role := list "gateway" "prefill" "decode" }}
{{- $_ = set $args (printf "%s_resource" $role) (include "tandem.rayResource" $role) }}
{{- end }}
{{- $_ = set $args "prefill_replicas" (include "tandem.initialReplicas" .Values.prefill | int) }}
{{- $_ = set $args "decode_replicas" (include "tandem.initialReplicas" .Values.decode | int) }}
{{- /* The head's gateway and one per gateway pod; they share the router's index in Redis. */}}
{{- $_ = set $args "gateway_replicas" (add1 (int .Values.gateway.replicas)) }}
{{- if and (gt (int .Values.gateway.replicas) 0) (not (include "tandem.redisUrl" .)) }}
{{- fail "gateway.replicas: gateways beside the head need a Redis (redis.enabled or redis.externalUrl): they share the router's prefix index and stored responses there" }}
{{- end }}
{{- if include "tandem.apiKeysSecret" . }}
{{- $_ = set $args "api_keys_file" (include "tandem.secretFile" (dict "ctx" . "key" "api-keys")) }}
{{- end }}
{{- $_ = set $args "cluster_secret_file" (include "tandem.secretFile" (dict "ctx" . "key" "cluster-secret")) }}
{{- if .Values.auth.metricsRequireKey }}
{{- $_ = set $args "metrics_require_key" true }}
{{- end }}
{{- if .Values.tls.existingSecret }}
{{- $_ = set $args "tls_cert_file" (include "tandem.secretFile" (dict "ctx" . "key" "tls.crt")) }}
{{- $_ = set $args "tls_key_file" (include "tandem.secretFile" (dict "ctx" . "key" "tls.key")) }}
{{- end }}
{{- if .Values.internalTls.existingSecret }}
{{- $_ = set $args "internal_tls_cert_file" (include "tandem.secretFile" (dict "ctx" . "key" "internal-tls.crt")) }}
{{- $_ = set $args "internal_tls_key_file" (include "tandem.secretFile" (dict "ctx" . "key" "internal-tls.key")) }}
{{- $_ = set $args "internal_tls_ca_file" (include "tandem.secretFile" (dict "ctx" . "key" "internal-ca.crt")) }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/* Engines the gateway waits for at start: the fixed count, or the autoscaling minimum. */}}
{{- define "tandem.initialReplicas" -}}
{{- if .autoscaling.enabled }}{{ .autoscaling.minReplicas }}{{ else }}{{ .replicas }}{{ end }}
{{- end }}

{{- define "tandem.maxReplicas" -}}
{{- if .autoscaling.enabled }}{{ .autoscaling.maxReplicas }}{{ else }}{{ .replicas }}{{ end }}
{{- end }}

{{/* GPUs of one engine of a role: (dict "role" "decode" "ctx" $). An engine (prefill or
decode) has app.tensor_parallel_size ranks, gpusPerReplica GPUs each. */}}
{{- define "tandem.engineGpus" -}}
{{- $v := index .ctx.Values .role }}
{{- $ranks := int (.ctx.Values.app.tensor_parallel_size | default 1) }}
{{- mul (int $v.gpusPerReplica) $ranks }}
{{- end }}

{{/* Serve deployment options for a worker role: (dict "role" "prefill" "values" .Values.prefill "ctx" .) */}}
{{- define "tandem.workerDeployment" -}}
{{- $v := .values }}
{{- $resources := dict (include "tandem.rayResource" .role) 1 }}
{{- $gpus := include "tandem.engineGpus" (dict "role" .role "ctx" .ctx) | int }}
{{- $actor := dict "num_cpus" 0 "num_gpus" $gpus "resources" $resources }}
{{- $d := dict "name" .role "ray_actor_options" $actor }}
{{- if $v.autoscaling.enabled }}
{{- $_ := set $d "num_replicas" "auto" }}
{{- $_ = set $d "autoscaling_config" (dict "min_replicas" $v.autoscaling.minReplicas "initial_replicas" $v.autoscaling.minReplicas "max_replicas" $v.autoscaling.maxReplicas "target_ongoing_requests" $v.autoscaling.targetOngoingRequests) }}
{{- end }}
{{- toYaml $d }}
{{- end }}

{{- define "tandem.serveConfig" -}}
{{- $gateway := dict "name" "gateway" "ray_actor_options" (dict "num_cpus" 0 "resources" (dict (include "tandem.rayResource" "gateway") 1)) }}
{{- $deployments := list $gateway (include "tandem.workerDeployment" (dict "role" "prefill" "values" .Values.prefill "ctx" .) | fromYaml) (include "tandem.workerDeployment" (dict "role" "decode" "values" .Values.decode "ctx" .) | fromYaml) }}
{{- $application := dict "name" "tandem" "route_prefix" nil "import_path" "tandem.services.app:app_builder" "args" (include "tandem.appArgs" . | fromYaml) "deployments" $deployments }}
{{- /* No Serve HTTP proxy: the gateway replica serves HTTP (and gRPC) on the head itself. */}}
{{- $config := dict "proxy_location" "Disabled" "applications" (list $application) }}
{{- toYaml $config }}
{{- end }}

{{/*
Security: the Secret holding the API keys (key api-keys), or nothing when keys are off.
*/}}
{{- define "tandem.apiKeysSecret" -}}
{{- $keys := .Values.auth.apiKeys }}
{{- $tenants := ($keys.create | default dict).tenants | default dict }}
{{- if and $keys.existingSecret $tenants }}
{{- fail "auth.apiKeys: set either existingSecret (your Secret) or create.tenants (the chart makes one), not both" }}
{{- end }}
{{- if $keys.existingSecret }}
{{- $keys.existingSecret }}
{{- else if $tenants }}
{{- include "tandem.fullname" . }}-api-keys
{{- end }}
{{- end }}

{{/* The Secret holding the cluster secret (key cluster-secret): the user's, or the chart's. */}}
{{- define "tandem.clusterSecretName" -}}
{{- .Values.auth.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "tandem.fullname" .)) }}
{{- end }}

{{/*
The Secret holding Ray's token (key auth_token, the key KubeRay reads): the user's, or the
chart's; nothing with auth.rayToken.enabled false.
*/}}
{{- define "tandem.rayTokenSecret" -}}
{{- if .Values.auth.rayToken.enabled }}
{{- .Values.auth.rayToken.existingSecret | default (printf "%s-ray-token" (include "tandem.fullname" .)) }}
{{- end }}
{{- end }}

{{/*
Ray's token authentication in a Ray container: the mode, and the token from the mounted file.
RAY_AUTH_TOKEN is set, empty, on purpose: KubeRay (authOptions) adds RAY_AUTH_TOKEN with the
token itself (from the Secret) to a container that has none, which would put it in every Ray
process's environment; Ray skips an empty RAY_AUTH_TOKEN and reads RAY_AUTH_TOKEN_PATH.
KubeRay's wait-gcs-ready init container copies this env and the mounts.
*/}}
{{- define "tandem.rayAuthEnv" -}}
{{- if include "tandem.rayTokenSecret" . }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN_PATH
  value: {{ include "tandem.secretFile" (dict "ctx" . "key" "ray-auth-token") }}
- name: RAY_AUTH_TOKEN
  value: ""
{{- end }}
{{- end }}

{{/* With model.hubId: the hub cache the init container filled, read offline. */}}
{{- define "tandem.hubEnv" -}}
{{- if .Values.model.hubId }}
- name: HF_HOME
  value: {{ include "tandem.hubHome" . }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- end }}

{{/* A Ray container's env: the chart's (Ray's token, the hub cache) and the user's:
(dict "ctx" $ "extra" list) */}}
{{- define "tandem.rayEnv" -}}
{{- $chart := concat (include "tandem.rayAuthEnv" .ctx | fromYamlArray) (include "tandem.hubEnv" .ctx | fromYamlArray) }}
{{- $env := concat $chart .extra }}
{{- if $env }}
{{- toYaml $env }}
{{- end }}
{{- end }}

{{/* A secret file's path in the pods: (dict "ctx" $ "key" "api-keys") */}}
{{- define "tandem.secretFile" -}}
{{- printf "%s/%s" (trimSuffix "/" .ctx.Values.auth.secretsMountPath) .key }}
{{- end }}

{{/*
Refusals: a Service reachable from outside the cluster with no keys, and a /metrics that needs a
key Prometheus is not given.
*/}}
{{- define "tandem.authChecks" -}}
{{- $keys := include "tandem.apiKeysSecret" . }}
{{- if not (or $keys .Values.auth.allowUnauthenticatedExposure) }}
{{- $how := "configure API keys first (auth.apiKeys.existingSecret, a Secret with key api-keys holding tenant:key lines), or set auth.allowUnauthenticatedExposure=true to serve anyone who reaches it" }}
{{- if eq .Values.service.type "LoadBalancer" }}
{{- fail (printf "service.type LoadBalancer exposes the API outside the cluster: %s" $how) }}
{{- end }}
{{- if eq .Values.service.type "NodePort" }}
{{- fail (printf "service.type NodePort exposes the API on every node's address: %s" $how) }}
{{- end }}
{{- if .Values.ingress.enabled }}
{{- fail (printf "ingress.enabled exposes the API through an Ingress: %s" $how) }}
{{- end }}
{{- end }}
{{- if .Values.auth.metricsRequireKey }}
{{- if not $keys }}
{{- fail "auth.metricsRequireKey needs API keys: set auth.apiKeys.existingSecret (or auth.apiKeys.create.tenants)" }}
{{- end }}
{{- $bearer := .Values.monitoring.serviceMonitor.bearerTokenSecret }}
{{- if and .Values.monitoring.serviceMonitor.enabled (not (and $bearer.name $bearer.key)) }}
{{- fail "auth.metricsRequireKey: Prometheus needs a key to scrape /metrics: set monitoring.serviceMonitor.bearerTokenSecret.name and .key (a Secret in the release's namespace holding one tenant's API key), or monitoring.serviceMonitor.enabled=false" }}
{{- end }}
{{- end }}
{{- if not .Values.podSecurityContext.fsGroup }}
{{- fail "podSecurityContext.fsGroup must be set: the secret files are mounted mode 0440, readable by that group" }}
{{- end }}
{{- if .Values.auth.rayToken.enabled }}
{{- if semverCompare "<2.52.0-0" (toString .Values.rayVersion) }}
{{- fail (printf "auth.rayToken needs Ray 2.52 or later (rayVersion is %s): use an image with a newer Ray, or set auth.rayToken.enabled=false" (toString .Values.rayVersion)) }}
{{- end }}
{{- $lists := dict "extraEnv" .Values.extraEnv "head.extraEnv" .Values.head.extraEnv "prefill.extraEnv" .Values.prefill.extraEnv "decode.extraEnv" .Values.decode.extraEnv }}
{{- range $where, $list := $lists }}
{{- range $list }}
{{- if has .name (list "RAY_AUTH_MODE" "RAY_AUTH_TOKEN" "RAY_AUTH_TOKEN_PATH") }}
{{- fail (printf "%s: %s is set by the chart (auth.rayToken): remove it, or set auth.rayToken.enabled=false" $where .name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.internalTls.existingSecret (eq (toString .Values.app.kv_transport) "nixl") }}
{{- fail "internalTls.existingSecret: app.kv_transport nixl cannot take internal TLS (NIXL's UCX moves KV bytes unencrypted): set app.kv_transport to tcp or auto (TCP over mutual TLS)" }}
{{- end }}
{{- if and .Values.tls.existingSecret .Values.monitoring.serviceMonitor.enabled (include "tandem.prometheusOperator" .) (not .Values.monitoring.serviceMonitor.tlsConfig) }}
{{- fail "tls.existingSecret: Prometheus scrapes /metrics over HTTPS and must be told how to check the certificate: set monitoring.serviceMonitor.tlsConfig (e.g. {ca: {secret: {name: <Secret>, key: ca.crt}}, serverName: <a name in the certificate>}, or {insecureSkipVerify: true}), or monitoring.serviceMonitor.enabled=false" }}
{{- end }}
{{- end }}

{{/*
The secret files of a pod: (dict "ctx" $ "gateway" true) for the head (the gateway reads the
API keys and the TLS certificate and key), false for workers (the internal TLS files). Every
pod: the cluster secret and Ray's token. One projected volume, mode 0440: the pod's fsGroup reads, nobody writes.
*/}}
{{- define "tandem.secretsVolume" -}}
{{- $ctx := .ctx }}
- name: secrets
  projected:
    defaultMode: 288  # 0440
    sources:
      {{- if and .gateway (include "tandem.apiKeysSecret" $ctx) }}
      - secret:
          name: {{ include "tandem.apiKeysSecret" $ctx }}
          items:
            - key: api-keys
              path: api-keys
      {{- end }}
      - secret:
          name: {{ include "tandem.clusterSecretName" $ctx }}
          items:
            - key: cluster-secret
              path: cluster-secret
      {{- with include "tandem.rayTokenSecret" $ctx }}
      - secret:
          name: {{ . }}
          items:
            - key: auth_token
              path: ray-auth-token
      {{- end }}
      {{- if and (not .gateway) $ctx.Values.internalTls.existingSecret }}
      - secret:
          name: {{ $ctx.Values.internalTls.existingSecret }}
          items:
            - key: tls.crt
              path: internal-tls.crt
            - key: tls.key
              path: internal-tls.key
            - key: ca.crt
              path: internal-ca.crt
      {{- end }}
      {{- if and .gateway $ctx.Values.tls.existingSecret }}
      - secret:
          name: {{ $ctx.Values.tls.existingSecret }}
          items:
            - key: tls.crt
              path: tls.crt
            - key: tls.key
              path: tls.key
      {{- end }}
{{- end }}

{{/* Volumes every Ray pod has: scratch space (read-only root) and the model (or the hub cache). */}}
{{- define "tandem.rayVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSizeLimit }}
- name: ray-session
  emptyDir:
    sizeLimit: {{ .Values.scratch.raySessionSizeLimit }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.scratch.shmSizeLimit }}
- name: home
  emptyDir:
    sizeLimit: 256Mi
{{- if .Values.model.path }}
- name: model
  {{- required "model.volume: set a volume source holding model.path (e.g. persistentVolumeClaim)" (.Values.model.volume | default nil) | toYaml | nindent 2 }}
{{- end }}
{{- if .Values.model.hubId }}
- name: hf-cache
  {{- toYaml .Values.model.hubCache | nindent 2 }}
{{- end }}
{{- end }}

{{- define "tandem.rayVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: ray-session
  mountPath: /tmp/ray
- name: dshm
  mountPath: /dev/shm
- name: home
  mountPath: /home/ray
- name: secrets
  mountPath: {{ .Values.auth.secretsMountPath }}
  readOnly: true
{{- if .Values.model.path }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.model.hubId }}
- name: hf-cache
  mountPath: {{ include "tandem.hubHome" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Container resources of a worker group, with its engine's GPUs: (dict "role" "decode" "ctx" $). */}}
{{- define "tandem.workerResources" -}}
{{- $r := deepCopy (index .ctx.Values .role).resources }}
{{- $gpus := include "tandem.engineGpus" . | int }}
{{- if gt $gpus 0 }}
{{- $gpu := .ctx.Values.accelerator.resource }}
{{- $_ := set $r "requests" (merge (dict $gpu $gpus) ($r.requests | default dict)) }}
{{- $_ = set $r "limits" (merge (dict $gpu $gpus) ($r.limits | default dict)) }}
{{- end }}
{{- toYaml $r }}
{{- end }}

{{/*
A group's scheduling settings (head, prefill, decode): where and how its pods are scheduled.
*/}}
{{- define "tandem.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- end }}
