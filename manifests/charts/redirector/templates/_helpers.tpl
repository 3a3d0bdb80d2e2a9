{{/*
redirector.values resolves the three layers of values, last wins:

  1. the chart defaults, kept under .Values.defaults in values.yaml;
  2. the profile, files/profile-<.Values.profile>.yaml;
  3. what the user set with --set or -f: every other top-level key.

Helm hands a chart (1) and (3) already merged into .Values, which leaves no room for (2).
Keeping (1) under "defaults" separates them again: merge a copy of the defaults, the profile,
then the user's keys, and put the result in place of .Values. Every template includes this
first thing; the first include does the work (the result has no "defaults" key any more),
and later ones find nothing to do, whichever order Helm renders the templates in.

A user key that is not a chart default fails the render, so `--set loglevel=debug` (a typo)
is not silently ignored.
*/}}
{{- define "redirector.values" -}}
{{- if hasKey .Values "defaults" -}}
{{- $profile := dict -}}
{{- with .Values.profile -}}
{{- $file := $.Files.Get (printf "files/profile-%s.yaml" .) -}}
{{- if not $file -}}
{{- fail (printf "profile %q does not exist: use one of %s" . (include "redirector.profiles" $)) -}}
{{- end -}}
{{- $profile = fromYaml $file -}}
{{- if hasKey $profile "Error" -}}
{{- fail (printf "files/profile-%s.yaml: %s" . $profile.Error) -}}
{{- end -}}
{{- end -}}
{{- $user := omit .Values "defaults" "profile" "global" -}}
{{- range $key, $_ := $user -}}
{{- if not (hasKey $.Values.defaults $key) -}}
{{- fail (printf "unknown value %q: not a setting of this chart (see its values.yaml)" $key) -}}
{{- end -}}
{{- end -}}
{{- $merged := mustMergeOverwrite (deepCopy .Values.defaults) $profile (deepCopy $user) -}}
{{- $_ := set $merged "profile" .Values.profile -}}
{{- $_ := set . "Values" $merged -}}
{{- end -}}
{{- end -}}

{{/* redirector.profiles lists the profiles the chart ships, for error messages. */}}
{{- define "redirector.profiles" -}}
{{- $names := list -}}
{{- range $path, $_ := .Files.Glob "files/profile-*.yaml" -}}
{{- $names = append $names (trimSuffix ".yaml" (trimPrefix "files/profile-" $path)) -}}
{{- end -}}
{{- join ", " (sortAlpha $names) -}}
{{- end -}}

{{/* redirector.fullname names every object: the release name, with the chart's appended. */}}
{{- define "redirector.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "redirector.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "redirector.labels" -}}
{{ include "redirector.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "redirector.image" -}}
{{- with .Values.image -}}
{{- if .digest -}}
{{ .repository }}@{{ .digest }}
{{- else -}}
{{ .repository }}:{{ .tag | default $.Chart.AppVersion }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* redirector.addr joins (list host port) into a listen address; IPv6 hosts get brackets. */}}
{{- define "redirector.addr" -}}
{{- $host := index . 0 | toString -}}
{{- $port := index . 1 | int -}}
{{- if contains ":" $host -}}
[{{ $host }}]:{{ $port }}
{{- else -}}
{{ $host }}:{{ $port }}
{{- end -}}
{{- end -}}

{{/* redirector.adminExposed: "true" when the admin endpoint listens beyond loopback. */}}
{{- define "redirector.adminExposed" -}}
{{- $host := .Values.admin.host | toString -}}
{{- if not (or (hasPrefix "127." $host) (eq $host "::1") (eq $host "localhost")) -}}true{{- end -}}
{{- end -}}

{{/*
redirector.securityContext is the agent's, shared by the node container, which runs
`redirector uninstall` when the DaemonSet is deleted. Why each part (docs: manifests/README.md):

  runAsUser 0           Kubernetes grants added capabilities to uid 0 only (no ambient caps).
  privileged false      everything needed is in the capability list below.
  NET_ADMIN             tcx/tc attach, policy-routing rules and routes and sysctls in pod
                        network namespaces; IP_TRANSPARENT and SO_MARK on tunnel sockets.
  SYS_ADMIN             setns() into pod network namespaces (no narrower capability allows it);
                        also passes the kernel's perfmon_capable() check, which the data path's
                        bpf_probe_read_kernel (TIME_WAIT reopen) needs: CAP_PERFMON would do,
                        and is not added as SYS_ADMIN must stay anyway.
  BPF                   bpf(): load programs, create, pin and update maps (kernel 5.8+).
  SYS_PTRACE            open /proc/<pid>/ns/net of pod processes running as other users, to
                        find the namespaces of pods that existed before the agent.
  DAC_OVERRIDE          write files root does not own: the sysctls of pods in their own user
                        namespace (hostUsers: false), host directories with other owners.
  NET_BIND_SERVICE      answer a captured DNS query from the address and port the pod asked (a
                        transparent socket bound to <resolver>:53 in the pod's namespace).
  AppArmor Unconfined   the runtime's default profile denies writes below /sys and
                        /proc/sys: pins under /sys/fs/bpf, sysctls in pod namespaces.
*/}}
{{- define "redirector.securityContext" -}}
privileged: false
runAsUser: 0
runAsGroup: 0
runAsNonRoot: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
  add: [NET_ADMIN, SYS_ADMIN, BPF, SYS_PTRACE, DAC_OVERRIDE, NET_BIND_SERVICE]
appArmorProfile:
  type: Unconfined
{{- with .Values.seccompProfile }}
seccompProfile:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.seLinuxOptions }}
seLinuxOptions:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}


{{/*
redirector.fileCA: "true" when the agents sign with a file CA (CA_DIR) instead of asking
istiod. Only the standalone profile may turn it on: a file CA puts a key that signs any
identity on every node, so it never comes from a stray --set on another profile.
*/}}
{{- define "redirector.fileCA" -}}
{{- if .Values.fileCA.enabled -}}
{{- if ne (toString .Values.profile) "standalone" -}}
{{- fail (printf "fileCA.enabled puts a key that can sign any identity on every node; only the standalone profile uses it (profile is %q): use --set profile=standalone if that is what you want, or leave it off and let istiod sign" (toString .Values.profile)) -}}
{{- end -}}
{{- if .Values.caAddress -}}
{{- fail (printf "caAddress %q and the standalone profile's file CA are exclusive: a node either signs itself or asks istiod" .Values.caAddress) -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/*
redirector.source is SOURCE, checked: kubernetes, or xds (istiod's workload xDS), which needs
istiod and so cannot go with the standalone profile's file CA.
*/}}
{{- define "redirector.source" -}}
{{- $s := toString .Values.source -}}
{{- if not (has $s (list "kubernetes" "xds")) -}}
{{- fail (printf "source %q is neither kubernetes nor xds" $s) -}}
{{- end -}}
{{- if and (eq $s "xds") (include "redirector.fileCA" .) -}}
{{- fail "source xds reads the mesh from istiod, and the standalone profile's file CA runs without istiod: use source kubernetes with it, or let istiod sign (fileCA.enabled=false)" -}}
{{- end -}}
{{- $s -}}
{{- end -}}

{{/*
redirector.caAddress is istiod's CA address: caAddress, else the istiod Service of the
revision in istioNamespace, as Istio's ztunnel chart derives it.
*/}}
{{- define "redirector.caAddress" -}}
{{- if .Values.caAddress -}}
{{ .Values.caAddress }}
{{- else -}}
istiod{{ with .Values.revision }}-{{ . }}{{ end }}.{{ .Values.istioNamespace }}.svc:15012
{{- end -}}
{{- end -}}
