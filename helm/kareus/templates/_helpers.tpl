{{/*
Names and labels shared by every template. Labels follow the Kubernetes recommended labels
(app.kubernetes.io/*); selector labels are the stable subset that never changes on upgrade.
*/}}

{{- define "kareus.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kareus.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kareus.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; call with (dict "ctx" $ "component" "operator"). */}}
{{- define "kareus.labels" -}}
helm.sh/chart: {{ include "kareus.chart" .ctx }}
{{ include "kareus.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: kareus
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kareus.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kareus.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kareus.operator.fullname" -}}
{{- printf "%s-operator" (include "kareus.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kareus.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "kareus.operator.fullname" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kareus.nodeAgent.fullname" -}}
{{- printf "%s-node-agent" (include "kareus.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kareus.nodeAgent.namespace" -}}
{{- .Values.nodeAgent.namespace.name -}}
{{- end -}}

{{- define "kareus.nodeAgent.serviceAccountName" -}}
{{- if .Values.nodeAgent.serviceAccount.create -}}
{{- default (include "kareus.nodeAgent.fullname" .) .Values.nodeAgent.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.nodeAgent.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The ConfigMap of per-pod clock ceilings (kareus_node.ceilings.DEFAULT_NAME), in the node agent's namespace. */}}
{{- define "kareus.clockCeilings.configMapName" -}}
kareus-clock-ceilings
{{- end -}}

{{- define "kareus.policy.configMapName" -}}
{{- printf "%s-policy" (include "kareus.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* image: (dict "image" .Values.operator.image "ctx" $) */}}
{{- define "kareus.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The policy document exactly as the operator and the node agent read it (kareus.policy). */}}
{{- define "kareus.policy.document" -}}
{{ toYaml .Values.policy }}
{{- end -}}

{{/* What the operator does in a namespace it watches: its CRD, the phase pods, Services and
ConfigMaps it owns (the policy ConfigMap is read through the same rule), and the Events it reports. */}}
{{- define "kareus.operator.rules" -}}
- apiGroups: ["kareus.dev"]
  resources: ["kareusjobs"]
  # delete: ttlSecondsAfterFinished removes the finished job (the real API server said 403 without it)
  verbs: ["get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["kareus.dev"]
  resources: ["kareusjobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["kareus.dev"]
  resources: ["kareusjobs/finalizers"]
  verbs: ["update"]
# The phases run as batch Jobs (the Job controller makes the pods); the operator reads the pods
# for their failures and nodes, and suspends and resumes the Jobs.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "delete", "patch", "update"]
# A child queued in Kueue is suspended and resumed through its Workload (spec.active).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "patch"]
# The energy-budget admission check sets its state in a Workload's status; a LocalQueue names the
# ClusterQueue whose checks apply to a job.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["localqueues"]
  verbs: ["get"]
# list: a child Job's pods refused by admission show only in the Job controller's FailedCreate Events.
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch", "list"]
{{- end -}}

{{/* `kareus-operator run` flags, rendered from operator.args only (keep them aligned here). */}}
{{- define "kareus.operator.args" -}}
{{- $args := .Values.operator.args -}}
- run
{{- range $args.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
- --metrics-port={{ $args.metricsPort }}
- --metrics-address=$(POD_IP)
- --health-port={{ $args.healthPort }}
- --health-address=$(POD_IP)
{{- if $args.verbose }}
- --verbose
{{- end }}
{{- range $args.extra }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Container securityContext of the node agent for nodeAgent.securityMode. */}}
{{- define "kareus.nodeAgent.securityContext" -}}
{{- if eq .Values.nodeAgent.securityMode "privileged" }}
privileged: true
runAsUser: 0
readOnlyRootFilesystem: {{ .Values.nodeAgent.readOnlyRootFilesystem }}
{{- else }}
# Only CAP_SYS_ADMIN (NVML clock locking); root without the other capabilities.
privileged: false
allowPrivilegeEscalation: false
runAsUser: 0
readOnlyRootFilesystem: {{ .Values.nodeAgent.readOnlyRootFilesystem }}
capabilities:
  drop:
    - ALL
  add:
    - SYS_ADMIN
seccompProfile:
  type: RuntimeDefault
{{- end }}
{{- end -}}

{{/* The node agent's config file (kareus_node.config.load_config). clockBounds and allowedNamespaces
come from the cluster policy, so the operator's plans and the agent's refusals use the same limits. */}}
{{- define "kareus.nodeAgent.config" -}}
{{- $agent := .Values.nodeAgent -}}
dryRun: {{ $agent.dryRun }}
allowedNamespaces:
  {{- toYaml .Values.policy.allowedNamespaces | nindent 2 }}
clockBounds:
  {{- toYaml .Values.policy.clockBounds | nindent 2 }}
{{- with $agent.limits }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* `kareus-node` flags (node_daemon/kareus_node/main.py); paths are the hostPath mounts. */}}
{{- define "kareus.nodeAgent.args" -}}
{{- $agent := .Values.nodeAgent -}}
- --backend={{ $agent.backend }}
{{- if eq $agent.backend "sim" }}
- --sim-gpus={{ $agent.sim.gpus }}
- --sim-product={{ $agent.sim.product }}
{{- with $agent.sim.deviceDir }}
- --sim-device-dir={{ . }}
{{- end }}
{{- end }}
- --config=/etc/kareus-node/config.yaml
- --socket={{ include "kareus.nodeAgent.socketPath" . }}
- --listen-tcp=$(HOST_IP):{{ $agent.port }}
- --state-dir={{ $agent.stateDir }}
- --pod-resources-socket={{ printf "%s/kubelet.sock" $agent.podResourcesDir }}
- --node-name=$(NODE_NAME)
- --proc-root=/proc
- --metrics-port={{ $agent.metricsPort }}
- --metrics-address=$(POD_IP)
- --metrics-auth={{ $agent.metricsAuth }}
- --clock-ceilings={{ include "kareus.nodeAgent.namespace" . }}/{{ include "kareus.clockCeilings.configMapName" . }}
- --health-port={{ $agent.healthPort }}
- --log-format={{ $agent.logFormat }}
- --log-level={{ $agent.logLevel | upper }}
{{- range $agent.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The agent's PriorityClass: the chart's own when nodeAgent.priorityClass.create, else nodeAgent.priorityClassName (may be empty). */}}
{{- define "kareus.nodeAgent.priorityClassName" -}}
{{- if .Values.nodeAgent.priorityClass.create -}}
{{- include "kareus.nodeAgent.fullname" . -}}
{{- else -}}
{{- .Values.nodeAgent.priorityClassName -}}
{{- end -}}
{{- end -}}

{{/* The daemon's socket; privileged or standalone clients mount nodeAgent.socketDir and find it there. */}}
{{- define "kareus.nodeAgent.socketPath" -}}
{{- printf "%s/node.sock" .Values.nodeAgent.socketDir -}}
{{- end -}}

{{- define "kareus.nodeAgent.probes" -}}
# The probes have a server of their own on the node's loopback (hostNetwork), apart from /metrics.
livenessProbe:
  httpGet:
    host: 127.0.0.1
    path: /healthz
    port: {{ .Values.nodeAgent.healthPort }}
  initialDelaySeconds: 10
  periodSeconds: 20
# Ready only while the socket is served and pod-to-GPU authorisation works (fail closed).
readinessProbe:
  httpGet:
    host: 127.0.0.1
    path: /readyz
    port: {{ .Values.nodeAgent.healthPort }}
  periodSeconds: 10
{{- end -}}

{{/* The label the operator puts on every child pod of a KareusJob (its value is the job name). */}}
{{- define "kareus.trainingPodJobLabel" -}}
kareus.dev/job-name
{{- end -}}

{{/* A label map as "k1=v1, k2=v2" for messages. */}}
{{- define "kareus.labelList" -}}
{{- $pairs := list -}}
{{- range $key, $value := . -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join ", " $pairs -}}
{{- end -}}

{{/* Operator settings (operator/kareus_operator/settings.py reads KAREUS_OPERATOR_<FIELD>). */}}
{{- define "kareus.operator.env" -}}
- name: KAREUS_OPERATOR_IMAGE
  value: {{ include "kareus.image" (dict "image" .Values.operator.workerImage "ctx" $) | quote }}
- name: KAREUS_OPERATOR_IMAGE_PULL_POLICY
  value: {{ .Values.operator.workerImage.pullPolicy | default "" | quote }}
- name: KAREUS_OPERATOR_IMAGE_PULL_SECRETS
  value: {{ include "kareus.workers.imagePullSecretNames" . | quote }}
- name: KAREUS_OPERATOR_RENDEZVOUS_TIMEOUT_S
  value: {{ .Values.workers.rendezvousTimeoutSeconds | quote }}
- name: KAREUS_OPERATOR_NODE_TOKEN_EXPIRATION_S
  value: {{ .Values.workers.nodeTokenExpirationSeconds | quote }}
- name: KAREUS_OPERATOR_SHM_SIZE
  value: {{ .Values.workers.gpuPods.shmSize | quote }}
- name: KAREUS_OPERATOR_GPU_POD_MEMORY_REQUEST
  value: {{ .Values.workers.gpuPods.memoryRequest | quote }}
- name: KAREUS_OPERATOR_GPU_POD_MEMORY_LIMIT
  value: {{ .Values.workers.gpuPods.memoryLimit | quote }}
- name: KAREUS_OPERATOR_OPTIMIZE_POD_CPU_REQUEST
  value: {{ .Values.workers.optimizePods.cpuRequest | quote }}
- name: KAREUS_OPERATOR_OPTIMIZE_POD_MEMORY_REQUEST
  value: {{ .Values.workers.optimizePods.memoryRequest | quote }}
- name: KAREUS_OPERATOR_OPTIMIZE_POD_MEMORY_LIMIT
  value: {{ .Values.workers.optimizePods.memoryLimit | quote }}
- name: KAREUS_OPERATOR_POLICY_CONFIGMAP
  value: {{ include "kareus.policy.configMapName" . | quote }}
- name: KAREUS_OPERATOR_POLICY_NAMESPACE
  value: {{ .Release.Namespace | quote }}
- name: KAREUS_OPERATOR_CLOCK_CEILINGS_NAMESPACE
  value: {{ ternary (include "kareus.nodeAgent.namespace" .) "" .Values.operator.publishClockCeilings | quote }}
- name: KAREUS_OPERATOR_CLOCK_CEILINGS_CONFIGMAP
  value: {{ include "kareus.clockCeilings.configMapName" . | quote }}
- name: KAREUS_OPERATOR_NODE_DAEMON_PORT
  value: {{ .Values.nodeAgent.port | quote }}
- name: KAREUS_OPERATOR_SERVICE_ACCOUNT
  value: {{ .Values.workers.serviceAccountName | quote }}
- name: KAREUS_OPERATOR_WATCH_NAMESPACES
  value: {{ join "," .Values.operator.args.watchNamespaces | quote }}
- name: KAREUS_OPERATOR_LEADER_ELECTION_LEASE
  value: {{ include "kareus.operator.fullname" . | quote }}
{{- if .Values.kueue.energyBudgetCheck.enabled }}
- name: KAREUS_OPERATOR_ENERGY_ADMISSION_CHECK
  value: {{ .Values.kueue.energyBudgetCheck.name | quote }}
- name: KAREUS_OPERATOR_ENERGY_ADMISSION_CLUSTERQUEUES
  value: {{ join "," .Values.kueue.energyBudgetCheck.clusterQueues | quote }}
{{- end }}
{{- range $name, $value := .Values.operator.settings }}
- name: {{ printf "KAREUS_OPERATOR_%s" $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}

{{/* Namespaces that get the worker service account: workers.namespaces, else the watched ones, else
the policy's allowed ones, else (the operator watches the whole cluster and every namespace may run
jobs) `default`, where a job without a namespace lands, so the quickstart runs as installed. */}}
{{- define "kareus.workers.namespaces" -}}
{{- $namespaces := .Values.workers.namespaces | default .Values.operator.args.watchNamespaces | default .Values.policy.allowedNamespaces -}}
{{- toJson (default (list "default") $namespaces) -}}
{{- end -}}

{{/* workers.imagePullSecrets as a JSON list of Secret names (entries may be names or {name: ...}). */}}
{{- define "kareus.workers.imagePullSecretNames" -}}
{{- $names := list -}}
{{- range .Values.workers.imagePullSecrets | default list -}}
{{- if kindIs "string" . -}}
{{- $names = append $names . -}}
{{- else -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- end -}}
{{- toJson (uniq $names) -}}
{{- end -}}

{{/* The node agent's affinity: nodeAgent.affinity, plus one required node-affinity term per GPU node
label (nodeAgent.gpuNodeLabels and extraGpuNodeLabels, `key=value` or `key`; terms are ORed), unless
nodeAgent.affinity brings its own required node affinity. YAML, empty for none. */}}
{{- define "kareus.nodeAgent.affinity" -}}
{{- $agent := .Values.nodeAgent -}}
{{- $affinity := deepCopy ($agent.affinity | default dict) -}}
{{- $terms := list -}}
{{- range concat ($agent.gpuNodeLabels | default list) ($agent.extraGpuNodeLabels | default list) | uniq -}}
{{- $kv := regexSplit "=" . 2 -}}
{{- $expression := dict "key" (first $kv) "operator" "Exists" -}}
{{- if eq (len $kv) 2 -}}
{{- $expression = dict "key" (first $kv) "operator" "In" "values" (list (last $kv)) -}}
{{- end -}}
{{- $terms = append $terms (dict "matchExpressions" (list $expression)) -}}
{{- end -}}
{{- if $terms -}}
{{- $node := $affinity.nodeAffinity | default dict -}}
{{- if not $node.requiredDuringSchedulingIgnoredDuringExecution -}}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" $terms) -}}
{{- end -}}
{{- $_ := set $affinity "nodeAffinity" $node -}}
{{- end -}}
{{- if $affinity -}}
{{- toYaml $affinity -}}
{{- end -}}
{{- end -}}

{{/* The cross-field rules of kareus.policy that values.schema.json cannot express, so an install
fails with the same message the operator would log instead of running with a policy it rejects. */}}
{{- define "kareus.policy.check" -}}
{{- $policy := .Values.policy -}}
{{- $allowed := $policy.allowedObjectives | default (list "maxThroughput" "timeBudget" "energyBudget") -}}
{{- if and $policy.defaultObjective (not (has $policy.defaultObjective $allowed)) -}}
{{- fail (printf "policy.defaultObjective: %q must be one of policy.allowedObjectives (%s)" $policy.defaultObjective (join ", " $allowed)) -}}
{{- end -}}
{{- $bounds := $policy.clockBounds | default dict -}}
{{- $default := $bounds.default | default dict -}}
{{- include "kareus.policy.checkBounds" (dict "where" "policy.clockBounds.default" "floor" $default.floorMHz "ceiling" $default.ceilingMHz) -}}
{{- range $model, $b := $bounds.gpuModels | default dict -}}
{{- $floor := $default.floorMHz -}}
{{- if not (kindIs "invalid" $b.floorMHz) }}{{ $floor = $b.floorMHz }}{{ end -}}
{{- $ceiling := $default.ceilingMHz -}}
{{- if not (kindIs "invalid" $b.ceilingMHz) }}{{ $ceiling = $b.ceilingMHz }}{{ end -}}
{{- include "kareus.policy.checkBounds" (dict "where" (printf "policy.clockBounds.gpuModels.%s" $model) "floor" $floor "ceiling" $ceiling) -}}
{{- end -}}
{{- end -}}

{{/* floor <= ceiling when both are set (values may be int64 from --set or float64 from files). */}}
{{- define "kareus.policy.checkBounds" -}}
{{- if and (not (kindIs "invalid" .floor)) (not (kindIs "invalid" .ceiling)) -}}
{{- if gt (float64 .floor) (float64 .ceiling) -}}
{{- fail (printf "%s: floor %v MHz exceeds ceiling %v MHz" .where .floor .ceiling) -}}
{{- end -}}
{{- end -}}
{{- end -}}
