package manifests

import (
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

// wantProfiles are the profiles the chart must ship; profiles() finds any others too.
var wantProfiles = []string{"debug", "default", "dual-stack", "standalone", "strict"}

// agentCaps is the documented capability set of the agent (templates/_helpers.tpl,
// README.md): adding or dropping one must change the docs and this list together. SYS_ADMIN
// covers setns() and the perfmon_capable() check of bpf_probe_read_kernel in the data path.
var agentCaps = []corev1.Capability{"BPF", "DAC_OVERRIDE", "NET_ADMIN", "NET_BIND_SERVICE", "SYS_ADMIN", "SYS_PTRACE"}

func TestChartShipsProfiles(t *testing.T) {
	got := profiles(t)
	for _, p := range wantProfiles {
		if !slices.Contains(got, p) {
			t.Errorf("profile %q missing; the chart has %v", p, got)
		}
	}
}

// TestEveryProfileRenders renders each profile and checks what must hold whatever the
// profile: the pod's security, mounts, scheduling, probes and RBAC.
func TestEveryProfileRenders(t *testing.T) {
	for _, p := range profiles(t) {
		t.Run(p, func(t *testing.T) {
			r := mustRender(t, renderOpts{set: []string{"profile=" + p}, apiVersions: []string{peerAuthnAPI}})
			checkObjects(t, r)
			checkPodScheduling(t, r.DaemonSet)
			checkSecurity(t, r.DaemonSet)
			checkMounts(t, r.DaemonSet, r.ConfigMap)
			checkProbesAndMetrics(t, r.DaemonSet)
			checkEnv(t, r.DaemonSet, r.ConfigMap)
			checkCA(t, r, p)
			checkRBAC(t, r)
			checkUninstallHook(t, r)
		})
	}
}

func checkObjects(t *testing.T, r *rendered) {
	t.Helper()
	for name, missing := range map[string]bool{
		"DaemonSet": r.DaemonSet == nil, "ServiceAccount": r.ServiceAccount == nil, "ConfigMap": r.ConfigMap == nil,
		"ClusterRole": r.ClusterRole == nil, "ClusterRoleBinding": r.ClusterRoleBinding == nil,
		"Role": r.Role == nil, "RoleBinding": r.RoleBinding == nil,
	} {
		if missing {
			t.Fatalf("no %s rendered:\n%s", name, r.Manifest)
		}
	}
	for _, ns := range []string{r.DaemonSet.Namespace, r.ServiceAccount.Namespace, r.ConfigMap.Namespace, r.Role.Namespace, r.RoleBinding.Namespace} {
		if ns != releaseNamespace {
			t.Errorf("namespaced object in %q, want the release namespace %q", ns, releaseNamespace)
		}
	}
}

func checkPodScheduling(t *testing.T, ds *appsv1.DaemonSet) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	if !spec.HostNetwork || spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		t.Errorf("hostNetwork %v, dnsPolicy %q: want true, ClusterFirstWithHostNet", spec.HostNetwork, spec.DNSPolicy)
	}
	// No hostPID: the host's /proc is mounted at /host/proc (PROC_DIR) instead.
	if spec.HostPID {
		t.Error("hostPID is on; the agent reads the host's processes from the /host/proc mount")
	}
	if spec.HostIPC {
		t.Error("hostIPC is on; nothing needs it")
	}
	if spec.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q, want system-node-critical", spec.PriorityClassName)
	}
	if want := []corev1.Toleration{{Operator: corev1.TolerationOpExists}}; !slices.Equal(spec.Tolerations, want) {
		t.Errorf("tolerations %+v, want exactly %+v (every taint)", spec.Tolerations, want)
	}
	if spec.NodeSelector["kubernetes.io/os"] != "linux" {
		t.Errorf("nodeSelector %v: want kubernetes.io/os=linux", spec.NodeSelector)
	}
	us := ds.Spec.UpdateStrategy
	// Surge: the new agent overlaps the old one on each node (issue 20).
	if us.Type != appsv1.RollingUpdateDaemonSetStrategyType || us.RollingUpdate == nil ||
		us.RollingUpdate.MaxUnavailable == nil || us.RollingUpdate.MaxUnavailable.IntValue() != 0 ||
		us.RollingUpdate.MaxSurge == nil || us.RollingUpdate.MaxSurge.IntValue() != 1 {
		t.Errorf("updateStrategy %+v, want RollingUpdate with maxSurge 1, maxUnavailable 0", us)
	}
	if spec.ServiceAccountName != ds.Name {
		t.Errorf("serviceAccountName %q, want %q", spec.ServiceAccountName, ds.Name)
	}
	if got := ds.Spec.Selector.MatchLabels; !maps.Equal(got, subset(ds.Spec.Template.Labels, got)) {
		t.Errorf("selector %v does not match the pod labels %v", got, ds.Spec.Template.Labels)
	}
	if ds.Spec.Template.Labels["istio.io/dataplane-mode"] != "none" {
		t.Error("the agent's own pods must carry istio.io/dataplane-mode=none")
	}
	// The order is the lifecycle: bpffs before anything pins, node-setup as a native
	// sidecar (stopped after the agent, so its clean-up never races a running agent).
	var names []string
	for _, c := range spec.InitContainers {
		names = append(names, c.Name)
	}
	if !slices.Equal(names, []string{"mount-bpffs", "node-setup"}) {
		t.Errorf("init containers %v, want [mount-bpffs node-setup]", names)
	}
	if rp := container(t, ds, "node-setup").RestartPolicy; rp == nil || *rp != corev1.ContainerRestartPolicyAlways {
		t.Error("node-setup is not a native sidecar (restartPolicy: Always)")
	}
	if len(spec.Containers) != 1 || spec.Containers[0].Name != "agent" {
		t.Errorf("containers %v, want only agent", spec.Containers)
	}
	if g := spec.TerminationGracePeriodSeconds; g == nil || *g < 20 {
		t.Errorf("terminationGracePeriodSeconds %v: too short for the drain and the clean-up", g)
	}
}

// subset returns the entries of m whose keys are in keys.
func subset(m, keys map[string]string) map[string]string {
	out := map[string]string{}
	for k := range keys {
		if v, ok := m[k]; ok {
			out[k] = v
		}
	}
	return out
}

func checkSecurity(t *testing.T, ds *appsv1.DaemonSet) {
	t.Helper()
	for _, name := range []string{"agent", "node-setup"} {
		c := container(t, ds, name)
		sc := c.SecurityContext
		if sc == nil || sc.Privileged == nil || *sc.Privileged {
			t.Errorf("%s: privileged must be explicitly false", name)
			continue
		}
		if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
			t.Errorf("%s: capabilities must drop ALL, got %+v", name, sc.Capabilities)
			continue
		}
		got := slices.Clone(sc.Capabilities.Add)
		slices.Sort(got)
		if !slices.Equal(got, agentCaps) {
			t.Errorf("%s: capabilities %v, want exactly %v", name, got, agentCaps)
		}
		if sc.RunAsUser == nil || *sc.RunAsUser != 0 {
			t.Errorf("%s: must run as uid 0, the only user added capabilities are granted to", name)
		}
		if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			t.Errorf("%s: root filesystem is writable", name)
		}
		if sc.AppArmorProfile == nil || sc.AppArmorProfile.Type != corev1.AppArmorProfileTypeUnconfined {
			t.Errorf("%s: AppArmor must be Unconfined (the default profile denies writes below /sys and /proc/sys)", name)
		}
		// Kubernetes rejects allowPrivilegeEscalation: false together with SYS_ADMIN.
		if sc.AllowPrivilegeEscalation != nil {
			t.Errorf("%s: allowPrivilegeEscalation set; with SYS_ADMIN the API server rejects false", name)
		}
	}

	// Only mount-bpffs is privileged, and only because Bidirectional propagation requires
	// it (API validation: "Bidirectional mount propagation is available only to privileged
	// containers"). Its single mount is the bpffs.
	mb := container(t, ds, "mount-bpffs")
	if mb.SecurityContext == nil || mb.SecurityContext.Privileged == nil || !*mb.SecurityContext.Privileged {
		t.Error("mount-bpffs must be privileged: its mount propagates to the host (Bidirectional)")
	}
	if len(mb.VolumeMounts) != 1 || mb.VolumeMounts[0].Name != "bpffs" {
		t.Errorf("mount-bpffs mounts %+v, want only bpffs", mb.VolumeMounts)
	}
	if !slices.Equal(mb.Command, []string{"redirector-node", "mount-bpffs"}) {
		t.Errorf("mount-bpffs runs %v", mb.Command)
	}
	spec := ds.Spec.Template.Spec
	for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
		privileged := c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
		if privileged && c.Name != "mount-bpffs" {
			t.Errorf("%s is privileged; only mount-bpffs may be", c.Name)
		}
		for _, m := range c.VolumeMounts {
			if m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional && !privileged {
				t.Errorf("%s mounts %s Bidirectional without privileged: the API server rejects that", c.Name, m.Name)
			}
		}
	}
}

// wantMount describes one volume mount and the host path behind it.
type wantMount struct {
	container, volume, path string
	propagation             corev1.MountPropagationMode // "" means none
	hostPath                string                      // "" for non-hostPath volumes
	readOnly                bool
}

func checkMounts(t *testing.T, ds *appsv1.DaemonSet, cm *corev1.ConfigMap) {
	t.Helper()
	hostToContainer, bidirectional := corev1.MountPropagationHostToContainer, corev1.MountPropagationBidirectional
	for _, w := range []wantMount{
		{"mount-bpffs", "bpffs", "/sys/fs/bpf", bidirectional, "/sys/fs/bpf", false},
		{"agent", "bpffs", "/sys/fs/bpf", hostToContainer, "/sys/fs/bpf", false},
		{"agent", "netns", "/var/run/netns", hostToContainer, "/var/run/netns", false},
		{"agent", "socket-dir", "/var/run/redirector", "", "/var/run/redirector", false},
		{"node-setup", "bpffs", "/sys/fs/bpf", hostToContainer, "/sys/fs/bpf", false},
		{"node-setup", "netns", "/var/run/netns", hostToContainer, "/var/run/netns", false},
		{"node-setup", "cni-bin", "/host/opt/cni/bin", "", "/opt/cni/bin", false},
		{"node-setup", "cni-conf", "/host/etc/cni/net.d", "", "/etc/cni/net.d", false},
		// Writable: the pods' per-namespace sysctls are written through it.
		{"agent", "host-proc", "/host/proc", "", "/proc", false},
		{"node-setup", "host-proc", "/host/proc", "", "/proc", false},
	} {
		checkMount(t, ds, w)
	}
	if cm.Data["PROC_DIR"] != "/host/proc" {
		t.Errorf("PROC_DIR = %q, want /host/proc, where the host's /proc is mounted", cm.Data["PROC_DIR"])
	}
	// Each container mounts only what it needs: the CA key, istiod's token and the roots
	// stay out of node-setup, the CNI directories out of the agent.
	for _, c := range []struct{ container, volume string }{
		{"node-setup", "ca"}, {"node-setup", "istio-token"}, {"node-setup", "istio-ca-root-cert"},
		{"agent", "cni-bin"}, {"agent", "cni-conf"},
	} {
		for _, m := range container(t, ds, c.container).VolumeMounts {
			if m.Name == c.volume {
				t.Errorf("%s mounts %s", c.container, c.volume)
			}
		}
	}
}

func checkMount(t *testing.T, ds *appsv1.DaemonSet, w wantMount) {
	t.Helper()
	c := container(t, ds, w.container)
	i := slices.IndexFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == w.volume })
	if i < 0 {
		t.Errorf("%s does not mount %s", w.container, w.volume)
		return
	}
	m := c.VolumeMounts[i]
	var prop corev1.MountPropagationMode
	if m.MountPropagation != nil {
		prop = *m.MountPropagation
	}
	if m.MountPath != w.path || prop != w.propagation || m.ReadOnly != w.readOnly {
		t.Errorf("%s mounts %s at %s (propagation %q, readOnly %v), want %s (%q, %v)",
			w.container, w.volume, m.MountPath, prop, m.ReadOnly, w.path, w.propagation, w.readOnly)
	}
	if w.hostPath != "" {
		v := volume(t, ds, w.volume)
		if v.HostPath == nil || v.HostPath.Path != w.hostPath {
			t.Errorf("volume %s is %+v, want hostPath %s", w.volume, v.VolumeSource, w.hostPath)
		}
	}
}

// checkCA: only the standalone profile signs on the node (CA_DIR, the CA Secret mounted);
// every other profile asks istiod with a projected token of audience istio-ca and the
// istio-ca-root-cert ConfigMap as roots, and has no Secret volume at all.
func checkCA(t *testing.T, r *rendered, profile string) {
	t.Helper()
	ds, cm := r.DaemonSet, r.ConfigMap.Data
	if cm["CLUSTER_ID"] != "Kubernetes" {
		t.Errorf("CLUSTER_ID %q, want Kubernetes (Istio's default)", cm["CLUSTER_ID"])
	}
	hasVolume := func(name string) bool {
		return slices.ContainsFunc(ds.Spec.Template.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == name })
	}
	if profile == "standalone" {
		if cm["CA_DIR"] != "/etc/redirector/ca" {
			t.Errorf("standalone: CA_DIR %q, want /etc/redirector/ca", cm["CA_DIR"])
		}
		checkMount(t, ds, wantMount{"agent", "ca", cm["CA_DIR"], "", "", true})
		if ca := volume(t, ds, "ca"); ca.Secret == nil || ca.Secret.SecretName != "redirector-ca" ||
			ca.Secret.DefaultMode == nil || *ca.Secret.DefaultMode != 0o400 {
			t.Errorf("standalone: ca volume %+v, want the Secret redirector-ca, mode 0400", ca.VolumeSource)
		}
		for _, k := range []string{"CA_ADDRESS", "CA_TOKEN_FILE", "CA_ROOT_CERT", "CA_ROOT_CERT_RELOAD"} {
			if v, ok := cm[k]; ok {
				t.Errorf("standalone: %s=%q set; the agent refuses CA_ADDRESS with CA_DIR, the rest is istiod's", k, v)
			}
		}
		for _, v := range []string{"istio-token", "istio-ca-root-cert"} {
			if hasVolume(v) {
				t.Errorf("standalone: volume %s, which only istiod mode uses", v)
			}
		}
		if !strings.Contains(r.Notes, "WARNING: standalone profile") || !strings.Contains(r.Notes, "redirector ca init") {
			t.Errorf("standalone NOTES neither warn about the key on every node nor say how to make the Secret:\n%s", r.Notes)
		}
		return
	}

	// No signing key on any node: no CA_DIR, no Secret volume, whatever the profile.
	if v, ok := cm["CA_DIR"]; ok {
		t.Errorf("CA_DIR=%q: only the standalone profile may sign on the node", v)
	}
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.Secret != nil {
			t.Errorf("volume %s mounts the Secret %s: no profile but standalone may put a CA key on the nodes", v.Name, v.Secret.SecretName)
		}
	}
	if cm["CA_ADDRESS"] != "istiod.istio-system.svc:15012" {
		t.Errorf("CA_ADDRESS %q, want istiod.istio-system.svc:15012", cm["CA_ADDRESS"])
	}
	if cm["CA_ROOT_CERT_RELOAD"] != "10s" {
		t.Errorf("CA_ROOT_CERT_RELOAD %q, want 10s", cm["CA_ROOT_CERT_RELOAD"])
	}

	// The token: projected for istiod only (audience istio-ca), bound to the pod (istiod's
	// node authorizer finds the agent's node through it), rotated by the kubelet.
	tok := volume(t, ds, "istio-token")
	if tok.Projected == nil || len(tok.Projected.Sources) != 1 || tok.Projected.Sources[0].ServiceAccountToken == nil {
		t.Fatalf("istio-token volume %+v, want one projected serviceAccountToken", tok.VolumeSource)
	}
	sat := tok.Projected.Sources[0].ServiceAccountToken
	if sat.Audience != "istio-ca" || sat.ExpirationSeconds == nil || *sat.ExpirationSeconds != 43200 {
		t.Errorf("istio-token: audience %q, expirationSeconds %v; want istio-ca and 43200, as ztunnel's", sat.Audience, sat.ExpirationSeconds)
	}
	checkMount(t, ds, wantMount{"agent", "istio-token", filepath.Dir(cm["CA_TOKEN_FILE"]), "", "", true})
	if filepath.Base(cm["CA_TOKEN_FILE"]) != sat.Path {
		t.Errorf("CA_TOKEN_FILE %q is not the projected token's file %q", cm["CA_TOKEN_FILE"], sat.Path)
	}

	// The roots: the ConfigMap istiod writes, a whole-volume mount (a subPath mount never
	// sees a root rotation), the file CA_ROOT_CERT names.
	roots := volume(t, ds, "istio-ca-root-cert")
	if roots.ConfigMap == nil || roots.ConfigMap.Name != "istio-ca-root-cert" || len(roots.ConfigMap.Items) > 0 {
		t.Errorf("istio-ca-root-cert volume %+v, want the whole ConfigMap istio-ca-root-cert", roots.VolumeSource)
	}
	if filepath.Base(cm["CA_ROOT_CERT"]) != "root-cert.pem" {
		t.Errorf("CA_ROOT_CERT %q: not the ConfigMap's root-cert.pem", cm["CA_ROOT_CERT"])
	}
	checkMount(t, ds, wantMount{"agent", "istio-ca-root-cert", filepath.Dir(cm["CA_ROOT_CERT"]), "", "", true})
	for _, m := range container(t, ds, "agent").VolumeMounts {
		if m.SubPath != "" || m.SubPathExpr != "" {
			t.Errorf("agent mounts %s with a subPath: updates of the volume never reach it", m.Name)
		}
	}
	if !strings.Contains(r.Notes, "CA_TRUSTED_NODE_ACCOUNTS") || !strings.Contains(r.Notes, releaseNamespace+"/"+r.ServiceAccount.Name) {
		t.Errorf("NOTES do not say that istiod must trust %s/%s as a node agent:\n%s", releaseNamespace, r.ServiceAccount.Name, r.Notes)
	}
	if strings.Contains(r.Notes, "WARNING: standalone") {
		t.Errorf("profile %s: NOTES warn about standalone", profile)
	}
}

func checkProbesAndMetrics(t *testing.T, ds *appsv1.DaemonSet) {
	t.Helper()
	agent := container(t, ds, "agent")
	rp := agent.ReadinessProbe
	if rp == nil || rp.HTTPGet == nil || rp.HTTPGet.Path != "/healthz/ready" || rp.HTTPGet.Port.IntValue() != 15021 {
		t.Errorf("readiness probe %+v, want GET :15021/healthz/ready", rp)
	}
	lp := agent.LivenessProbe
	if lp == nil || lp.TCPSocket == nil || lp.TCPSocket.Port.IntValue() != 15021 {
		t.Errorf("liveness probe %+v, want a TCP check of :15021", lp)
	} else if lp.FailureThreshold*lp.PeriodSeconds < 30 {
		t.Errorf("liveness gives up after %ds: too eager for a node agent", lp.FailureThreshold*lp.PeriodSeconds)
	}
	// A hostNetwork pod's declared ports become hostPorts, which keep a
	// surge pod off its predecessor's node: none are declared.
	if len(agent.Ports) != 0 {
		t.Errorf("agent ports %v: a surge rollout needs none declared", agent.Ports)
	}
	ann := ds.Spec.Template.Annotations
	for k, v := range map[string]string{"prometheus.io/scrape": "true", "prometheus.io/port": "15020", "prometheus.io/path": "/metrics"} {
		if ann[k] != v {
			t.Errorf("pod annotation %s=%q, want %q", k, ann[k], v)
		}
	}
	if ann["checksum/config"] == "" {
		t.Error("no checksum/config annotation: a settings change would not roll the pods")
	}
}

func checkEnv(t *testing.T, ds *appsv1.DaemonSet, cm *corev1.ConfigMap) {
	t.Helper()
	if cm.Data["SOURCE"] != "kubernetes" {
		t.Errorf("SOURCE=%q, want kubernetes", cm.Data["SOURCE"])
	}
	// The agent listens where the plugin (told by node-setup) connects: the same host
	// directory, seen from the agent's container.
	sock := cm.Data["CNI_SOCKET"]
	agentMount := slices.IndexFunc(container(t, ds, "agent").VolumeMounts, func(m corev1.VolumeMount) bool {
		return m.Name == "socket-dir" && m.MountPath+"/cni.sock" == sock
	})
	hostSock, _ := env(container(t, ds, "node-setup"), "PLUGIN_AGENT_SOCKET")
	if agentMount < 0 || hostSock != volume(t, ds, "socket-dir").HostPath.Path+"/cni.sock" {
		t.Errorf("agent CNI_SOCKET %q and plugin agentSocket %q are not the same file of socket-dir", sock, hostSock)
	}
	// An upgrade's two agent pods meet at the hand-over socket: a file of the host's
	// socket-dir, which both mount, never of a container's own file system.
	handover := cm.Data["HANDOVER_SOCKET"]
	if !slices.ContainsFunc(container(t, ds, "agent").VolumeMounts, func(m corev1.VolumeMount) bool {
		return m.Name == "socket-dir" && m.MountPath+"/handover.sock" == handover
	}) {
		t.Errorf("agent HANDOVER_SOCKET %q is not a file of the socket-dir volume", handover)
	}
	for _, name := range []string{"agent", "node-setup"} {
		c := container(t, ds, name)
		if len(c.EnvFrom) != 1 || c.EnvFrom[0].ConfigMapRef == nil || c.EnvFrom[0].ConfigMapRef.Name != cm.Name {
			t.Errorf("%s: envFrom %+v, want the ConfigMap %s", name, c.EnvFrom, cm.Name)
		}
	}
	downward := map[string]string{}
	for _, e := range container(t, ds, "agent").Env {
		if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			downward[e.Name] = e.ValueFrom.FieldRef.FieldPath
		}
	}
	if want := map[string]string{"NODE_NAME": "spec.nodeName", "POD_NAMESPACE": "metadata.namespace",
		"POD_NAME": "metadata.name", "INSTANCE_IP": "status.podIP"}; !maps.Equal(downward, want) {
		t.Errorf("agent downward-API env %v, want %v", downward, want)
	}
}

// rule is one (API group, resource, verb) grant, with its resourceNames.
type rule struct{ group, resource, verb, names string }

func flatten(rules []rbacv1.PolicyRule) []rule {
	var out []rule
	for _, r := range rules {
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				for _, v := range r.Verbs {
					out = append(out, rule{g, res, v, strings.Join(r.ResourceNames, ",")})
				}
			}
		}
		if len(r.NonResourceURLs) > 0 {
			out = append(out, rule{"", "nonResourceURLs", strings.Join(r.NonResourceURLs, ","), ""})
		}
	}
	slices.SortFunc(out, func(a, b rule) int { return strings.Compare(fmt.Sprint(a), fmt.Sprint(b)) })
	return out
}

// checkUninstallHook: the pre-delete hook deletes this DaemonSet in the foreground, as the
// chart's ServiceAccount, with no privilege at all.
func checkUninstallHook(t *testing.T, r *rendered) {
	t.Helper()
	j := r.UninstallJob
	if j == nil {
		t.Fatal("no pre-delete hook Job: helm uninstall would delete the RBAC before the pods ask whether their DaemonSet is gone")
	}
	if j.Annotations["helm.sh/hook"] != "pre-delete" || !strings.Contains(j.Annotations["helm.sh/hook-delete-policy"], "hook-succeeded") {
		t.Errorf("hook annotations %v, want pre-delete, deleted once it succeeded", j.Annotations)
	}
	if j.Namespace != releaseNamespace {
		t.Errorf("hook Job in %q, want %q", j.Namespace, releaseNamespace)
	}
	spec := j.Spec.Template.Spec
	if spec.ServiceAccountName != r.ServiceAccount.Name+"-uninstall" || spec.HostNetwork || spec.HostPID || spec.RestartPolicy != corev1.RestartPolicyNever {
		t.Errorf("hook pod: serviceAccount %q, hostNetwork %v, hostPID %v, restartPolicy %q", spec.ServiceAccountName, spec.HostNetwork, spec.HostPID, spec.RestartPolicy)
	}
	if len(spec.Containers) != 1 || !slices.Equal(spec.Containers[0].Command, []string{"redirector-node", "delete-daemonset"}) {
		t.Fatalf("hook containers %+v, want one running redirector-node delete-daemonset", spec.Containers)
	}
	c := spec.Containers[0]
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	if env["DAEMONSET_NAME"] != r.DaemonSet.Name {
		t.Errorf("hook DAEMONSET_NAME %q, want %q", env["DAEMONSET_NAME"], r.DaemonSet.Name)
	}
	sc, psc := c.SecurityContext, spec.SecurityContext
	if sc == nil || psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.Capabilities == nil || len(sc.Capabilities.Add) > 0 || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Errorf("hook security context %+v (pod %+v): want non-root, no capabilities, no escalation, read-only root", sc, psc)
	}
	// Not a pod of the DaemonSet.
	if sel := r.DaemonSet.Spec.Selector.MatchLabels; maps.Equal(sel, subset(j.Spec.Template.Labels, sel)) {
		t.Errorf("hook pod labels %v match the DaemonSet's selector %v", j.Spec.Template.Labels, sel)
	}
	if d := j.Spec.ActiveDeadlineSeconds; d == nil || *d <= *r.DaemonSet.Spec.Template.Spec.TerminationGracePeriodSeconds {
		t.Errorf("hook activeDeadlineSeconds %v: must outlast the pods' termination", d)
	}
}

func checkRBAC(t *testing.T, r *rendered) {
	t.Helper()
	if r.ConfigMap.Data["SOURCE"] == "xds" {
		checkClusterRole(t, r, xdsRules())
	} else {
		checkClusterRole(t, r, kubernetesRules())
	}
	checkOtherRBAC(t, r)
}

// xdsRules are exactly the calls of the xDS source's own watches (pkg/source/nodepods:
// namespaces, its node's pods, RuntimeClasses) and the annotator's: istiod sends the rest.
func xdsRules() []rule {
	var want []rule
	for _, v := range []string{"get", "list", "watch"} {
		want = append(want, rule{"", "namespaces", v, ""}, rule{"", "pods", v, ""}, rule{"node.k8s.io", "runtimeclasses", v, ""})
	}
	return append(want, rule{"", "pods/status", "patch", ""})
}

func checkClusterRole(t *testing.T, r *rendered, want []rule) {
	t.Helper()
	slices.SortFunc(want, func(a, b rule) int { return strings.Compare(fmt.Sprint(a), fmt.Sprint(b)) })
	if got := flatten(r.ClusterRole.Rules); !slices.Equal(got, want) {
		t.Errorf("ClusterRole (SOURCE=%s) grants\n%v\nwant exactly\n%v", r.ConfigMap.Data["SOURCE"], got, want)
	}
}

// kubernetesRules are exactly the calls of pkg/source/kubernetes (see its package comment).
func kubernetesRules() []rule {
	var want []rule
	for _, res := range []string{"namespaces", "pods", "services"} {
		for _, v := range []string{"get", "list", "watch"} {
			want = append(want, rule{"", res, v, ""})
		}
	}
	// Nodes for their locality labels, through an informer only.
	want = append(want, rule{"", "nodes", "list", ""}, rule{"", "nodes", "watch", ""})
	// The annotation goes through pods/status: the status strategy keeps the spec.
	want = append(want, rule{"", "pods/status", "patch", ""})
	// The two policy CRDs, by name: installed but not served yet is not "missing".
	want = append(want, rule{"apiextensions.k8s.io", "customresourcedefinitions", "get",
		"peerauthentications.security.istio.io,authorizationpolicies.security.istio.io"})
	for _, v := range []string{"get", "list", "watch"} {
		want = append(want, rule{"discovery.k8s.io", "endpointslices", v, ""})
		want = append(want, rule{"node.k8s.io", "runtimeclasses", v, ""})
		want = append(want, rule{"security.istio.io", "peerauthentications", v, ""})
		want = append(want, rule{"security.istio.io", "authorizationpolicies", v, ""})
	}
	return want
}

// checkOtherRBAC checks the grants that do not depend on the source.
func checkOtherRBAC(t *testing.T, r *rendered) {
	t.Helper()
	if got, want := flatten(r.Role.Rules), []rule{{"apps", "daemonsets", "get", r.DaemonSet.Name}}; !slices.Equal(got, want) {
		t.Errorf("Role grants %v, want exactly %v (its own DaemonSet, read by node-setup: a delete would turn the mesh off on every node)", got, want)
	}
	if r.UninstallRole == nil || r.UninstallServiceAccount == nil || r.UninstallRoleBinding == nil {
		t.Fatal("no account of the pre-delete hook's own (ServiceAccount, Role, RoleBinding named -uninstall)")
	}
	if got, want := flatten(r.UninstallRole.Rules), []rule{{"apps", "daemonsets", "delete", r.DaemonSet.Name}, {"apps", "daemonsets", "get", r.DaemonSet.Name}}; !slices.Equal(got, want) {
		t.Errorf("the hook's Role grants %v, want exactly %v", got, want)
	}
	hookSA := rbacv1.Subject{Kind: "ServiceAccount", Name: r.UninstallServiceAccount.Name, Namespace: r.UninstallServiceAccount.Namespace}
	if b := r.UninstallRoleBinding; b.RoleRef.Name != r.UninstallRole.Name || !slices.Equal(b.Subjects, []rbacv1.Subject{hookSA}) {
		t.Errorf("the hook's RoleBinding binds %s to %+v, want %s to %+v", b.RoleRef.Name, b.Subjects, r.UninstallRole.Name, hookSA)
	}
	if got := r.UninstallJob.Spec.Template.Spec.ServiceAccountName; got != r.UninstallServiceAccount.Name {
		t.Errorf("the pre-delete hook runs as %q, want its own account %q", got, r.UninstallServiceAccount.Name)
	}
	for _, rl := range slices.Concat(r.ClusterRole.Rules, r.Role.Rules, r.UninstallRole.Rules) {
		for _, list := range [][]string{rl.APIGroups, rl.Resources, rl.Verbs, rl.ResourceNames} {
			if slices.Contains(list, "*") {
				t.Errorf("wildcard in rule %+v", rl)
			}
		}
	}
	sa := rbacv1.Subject{Kind: "ServiceAccount", Name: r.ServiceAccount.Name, Namespace: r.ServiceAccount.Namespace}
	for name, b := range map[string]struct {
		ref      rbacv1.RoleRef
		subjects []rbacv1.Subject
		target   string
	}{
		"ClusterRoleBinding": {r.ClusterRoleBinding.RoleRef, r.ClusterRoleBinding.Subjects, r.ClusterRole.Name},
		"RoleBinding":        {r.RoleBinding.RoleRef, r.RoleBinding.Subjects, r.Role.Name},
	} {
		if b.ref.Name != b.target || !slices.Equal(b.subjects, []rbacv1.Subject{sa}) {
			t.Errorf("%s binds %s to %+v, want %s to %+v", name, b.ref.Name, b.subjects, b.target, sa)
		}
	}
}

// TestPrecedence: what the user sets (--set, -f) wins over the profile, which wins over the
// chart defaults, key by key and at any depth.
func TestPrecedence(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts renderOpts
		key  string // ConfigMap key, or env:NAME of the node-setup container
		want string
	}{
		{"chart default", renderOpts{}, "LOG_LEVEL", "info"},
		{"no profile at all", renderOpts{set: []string{"profile="}}, "LOG_LEVEL", "info"},
		{"profile beats default", renderOpts{set: []string{"profile=debug"}}, "LOG_LEVEL", "debug"},
		{"--set beats profile", renderOpts{set: []string{"profile=debug", "logLevel=warn"}}, "LOG_LEVEL", "warn"},
		{"--set beats default", renderOpts{set: []string{"logLevel=error"}}, "LOG_LEVEL", "error"},
		{"-f beats profile", renderOpts{set: []string{"profile=debug"}, valuesYAML: "logLevel: warn\n"}, "LOG_LEVEL", "warn"},
		{"--set beats -f", renderOpts{valuesYAML: "logLevel: warn\n", set: []string{"logLevel=error"}}, "LOG_LEVEL", "error"},
		{"profile keeps keys the user did not set", renderOpts{set: []string{"profile=debug", "logLevel=warn"}}, "RECONCILE_PERIOD", "10s"},
		{"false beats a profile's true", renderOpts{set: []string{"profile=debug", "cni.verbose=false"}}, "env:VERBOSE", "false"},
		{"nested: user port, profile host", renderOpts{set: []string{"profile=debug", "admin.port=16000"}}, "ADMIN_ADDR", ":16000"},
		{"nested: user port, default host", renderOpts{set: []string{"admin.port=16000"}}, "ADMIN_ADDR", "127.0.0.1:16000"},
		{"a list replaces the default list", renderOpts{set: []string{"excludeNamespaces={kube-system,monitoring}"}}, "EXCLUDE_NAMESPACES", "kube-system,monitoring"},
		{"an empty list replaces the default list", renderOpts{valuesYAML: "excludeNamespaces: []\n"}, "EXCLUDE_NAMESPACES", ""},
		{"IPv6 admin host", renderOpts{set: []string{"admin.host=::1"}}, "ADMIN_ADDR", "[::1]:15000"},
		{"user value inside a profile's map", renderOpts{set: []string{"profile=dual-stack", "hostProbeSNAT.ipv6=fd00:7127::1"}}, "HOST_PROBE_SNAT_IPV6", "fd00:7127::1"},
		{"profile map keeps the other key", renderOpts{set: []string{"profile=dual-stack", "hostProbeSNAT.ipv6=fd00:7127::1"}}, "HOST_PROBE_SNAT_IP", "169.254.7.127"},
		{"numbers from --set", renderOpts{set: []string{"pool.maxStreams=250"}}, "POOL_MAX_STREAMS", "250"},
		{"large numbers stay plain", renderOpts{set: []string{"limits.maxConnections=1000000"}}, "MAX_CONNECTIONS", "1000000"},
		{"false from --set", renderOpts{set: []string{"accessLog=false"}}, "ACCESS_LOG", "false"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := mustRender(t, tc.opts)
			var got string
			var ok bool
			if name, isEnv := strings.CutPrefix(tc.key, "env:"); isEnv {
				got, ok = env(container(t, r.DaemonSet, "node-setup"), name)
			} else {
				got, ok = r.ConfigMap.Data[tc.key]
			}
			if !ok || got != tc.want {
				t.Errorf("%s = %q (set: %v), want %q", tc.key, got, ok, tc.want)
			}
		})
	}
}

// TestRendersDoNotLeak: a render must not change the loaded chart's defaults, or a
// profile or --set of one install would show up in the next (helm's SDK users, and these
// tests, reuse a loaded chart).
func TestRendersDoNotLeak(t *testing.T) {
	mustRender(t, renderOpts{set: []string{"profile=debug", "logLevel=warn", "admin.port=16000", "cni.binDir=/x"}})
	r := mustRender(t, renderOpts{})
	if got := r.ConfigMap.Data["LOG_LEVEL"] + " " + r.ConfigMap.Data["ADMIN_ADDR"] + " " + r.ConfigMap.Data["RECONCILE_PERIOD"]; got != "info 127.0.0.1:15000 30s" {
		t.Errorf("second render got %q: the first one changed the chart's defaults", got)
	}
	if v := volume(t, r.DaemonSet, "cni-bin"); v.HostPath.Path != "/opt/cni/bin" {
		t.Errorf("second render's cni-bin is %s", v.HostPath.Path)
	}
}

func TestRenderErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts renderOpts
		want string
	}{
		{"typo in a key", renderOpts{set: []string{"loglevel=debug"}}, `unknown value "loglevel"`},
		{"typo in a -f file", renderOpts{valuesYAML: "cnii: {enabled: false}\n"}, `unknown value "cnii"`},
		{"unknown profile", renderOpts{set: []string{"profile=fast"}}, `profile "fast" does not exist: use one of debug, default, dual-stack, standalone, strict`},
		{"file CA without the standalone profile", renderOpts{set: []string{"fileCA.enabled=true"}}, `only the standalone profile uses it (profile is "default")`},
		{"file CA with another profile", renderOpts{set: []string{"profile=debug", "fileCA.enabled=true"}}, `only the standalone profile uses it (profile is "debug")`},
		{"file CA with no profile", renderOpts{set: []string{"profile=", "fileCA.enabled=true"}}, `only the standalone profile uses it (profile is "")`},
		{"file CA and istiod", renderOpts{set: []string{"profile=standalone", "caAddress=istiod.x.svc:15012"}}, `caAddress "istiod.x.svc:15012" and the standalone profile's file CA are exclusive`},
		{"old ca.secretName value", renderOpts{set: []string{"ca.secretName=x"}}, `unknown value "ca"`},
		{"strict without Istio's CRDs", renderOpts{set: []string{"profile=strict"}}, "does not serve"},
		{"bad mTLS mode", renderOpts{set: []string{"meshMTLSMode=strict"}, apiVersions: []string{peerAuthnAPI}}, `meshMTLSMode "strict" is not STRICT`},
		{"cluster without native sidecars", renderOpts{kubeVersion: "v1.29.4"}, "incompatible with Kubernetes v1.29.4"},
		{"unknown source", renderOpts{set: []string{"source=file:/x"}}, `source "file:/x" is neither kubernetes nor xds`},
		{"xds with the file CA", renderOpts{set: []string{"profile=standalone", "source=xds"}}, "source xds reads the mesh from istiod"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := render(t, tc.opts)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestStrictProfile(t *testing.T) {
	r := mustRender(t, renderOpts{set: []string{"profile=strict"}, apiVersions: []string{peerAuthnAPI}})
	pa := r.PeerAuthentication
	if pa == nil {
		t.Fatal("profile strict renders no PeerAuthentication")
	}
	if pa.Name != "default" || pa.Namespace != "istio-system" || pa.Spec.MTLS.Mode != "STRICT" {
		t.Errorf("PeerAuthentication %s/%s mode %q, want istio-system/default STRICT", pa.Namespace, pa.Name, pa.Spec.MTLS.Mode)
	}
	// The policy follows the agent's root namespace, where mesh-wide policies live.
	r = mustRender(t, renderOpts{set: []string{"profile=strict", "rootNamespace=mesh-root"}, apiVersions: []string{peerAuthnAPI}})
	if r.PeerAuthentication.Namespace != "mesh-root" || r.ConfigMap.Data["ROOT_NAMESPACE"] != "mesh-root" {
		t.Errorf("PeerAuthentication in %q, ROOT_NAMESPACE %q: want both mesh-root", r.PeerAuthentication.Namespace, r.ConfigMap.Data["ROOT_NAMESPACE"])
	}
	for _, p := range []string{"default", "debug", "dual-stack"} {
		if r := mustRender(t, renderOpts{set: []string{"profile=" + p}}); r.PeerAuthentication != nil {
			t.Errorf("profile %s renders a PeerAuthentication", p)
		}
	}
}

func TestDebugProfile(t *testing.T) {
	r := mustRender(t, renderOpts{set: []string{"profile=debug"}})
	cm := r.ConfigMap.Data
	if cm["LOG_LEVEL"] != "debug" || cm["ADMIN_ADDR"] != ":15000" {
		t.Errorf("LOG_LEVEL %q, ADMIN_ADDR %q: want debug and every address", cm["LOG_LEVEL"], cm["ADMIN_ADDR"])
	}
	if v, _ := env(container(t, r.DaemonSet, "node-setup"), "VERBOSE"); v != "true" {
		t.Errorf("node-setup VERBOSE %q, want true", v)
	}
	if !strings.Contains(r.Notes, "WARNING: the admin endpoint") {
		t.Errorf("NOTES do not warn about the exposed admin endpoint:\n%s", r.Notes)
	}
	// The default keeps admin on loopback and says nothing.
	r = mustRender(t, renderOpts{})
	if r.ConfigMap.Data["ADMIN_ADDR"] != "127.0.0.1:15000" || strings.Contains(r.Notes, "WARNING") {
		t.Errorf("default ADMIN_ADDR %q; notes:\n%s", r.ConfigMap.Data["ADMIN_ADDR"], r.Notes)
	}
}

// TestIstiodSettings: istiod is found as Istio's ztunnel chart finds it (revision and
// namespace, or caAddress), and the cluster name and trust bundle follow the values.
func TestIstiodSettings(t *testing.T) {
	for _, tc := range []struct {
		set  []string
		key  string
		want string
	}{
		{[]string{"revision=canary"}, "CA_ADDRESS", "istiod-canary.istio-system.svc:15012"},
		{[]string{"istioNamespace=mesh"}, "CA_ADDRESS", "istiod.mesh.svc:15012"},
		{[]string{"istioNamespace=mesh", "revision=1-27"}, "CA_ADDRESS", "istiod-1-27.mesh.svc:15012"},
		{[]string{"revision=canary", "caAddress=ca.example:15012"}, "CA_ADDRESS", "ca.example:15012"},
		{[]string{"multiCluster.clusterName=east"}, "CLUSTER_ID", "east"},
		{[]string{"profile=standalone", "multiCluster.clusterName=east"}, "CLUSTER_ID", "east"},
		{[]string{"caRootCertReload=1m"}, "CA_ROOT_CERT_RELOAD", "1m"},
		{[]string{"network=east"}, "NETWORK", "east"},
		{nil, "NETWORK", ""},
		{[]string{"profile=standalone", "fileCA.mountPath=/ca"}, "CA_DIR", "/ca"},
	} {
		r := mustRender(t, renderOpts{set: tc.set})
		if got := r.ConfigMap.Data[tc.key]; got != tc.want {
			t.Errorf("--set %v: %s=%q, want %q", tc.set, tc.key, got, tc.want)
		}
	}
	r := mustRender(t, renderOpts{set: []string{"trustBundleName=istio-ca-root-cert-canary"}})
	if v := volume(t, r.DaemonSet, "istio-ca-root-cert"); v.ConfigMap == nil || v.ConfigMap.Name != "istio-ca-root-cert-canary" {
		t.Errorf("trustBundleName: roots volume %+v", v.VolumeSource)
	}
	r = mustRender(t, renderOpts{set: []string{"profile=standalone", "fileCA.secretName=my-ca"}})
	if v := volume(t, r.DaemonSet, "ca"); v.Secret == nil || v.Secret.SecretName != "my-ca" {
		t.Errorf("fileCA.secretName: ca volume %+v", v.VolumeSource)
	}
	// The standalone profile can be turned back to istiod, never the other way round.
	r = mustRender(t, renderOpts{set: []string{"profile=standalone", "fileCA.enabled=false"}})
	if _, ok := r.ConfigMap.Data["CA_DIR"]; ok || r.ConfigMap.Data["CA_ADDRESS"] == "" {
		t.Errorf("standalone with fileCA.enabled=false: CA_DIR set or CA_ADDRESS %q empty", r.ConfigMap.Data["CA_ADDRESS"])
	}
}

// TestSourceXDS: source=xds reaches the agent, and its ClusterRole is only what the xDS
// source reads itself (checkRBAC); every profile but standalone takes it.
func TestSourceXDS(t *testing.T) {
	for _, p := range []string{"default", "strict", "debug", "dual-stack"} {
		r := mustRender(t, renderOpts{set: []string{"profile=" + p, "source=xds"}, apiVersions: []string{peerAuthnAPI}})
		if got := r.ConfigMap.Data["SOURCE"]; got != "xds" {
			t.Errorf("%s: SOURCE=%q, want xds", p, got)
		}
		checkRBAC(t, r)
	}
	if got := mustRender(t, renderOpts{}).ConfigMap.Data["SOURCE"]; got != "kubernetes" {
		t.Errorf("default SOURCE=%q, want kubernetes", got)
	}
}

func TestDualStackProfile(t *testing.T) {
	r := mustRender(t, renderOpts{set: []string{"profile=dual-stack"}})
	if got := r.ConfigMap.Data["HOST_PROBE_SNAT_IPV6"]; got != "fd16:9254:7127:1337:ffff:ffff:ffff:ffff" {
		t.Errorf("HOST_PROBE_SNAT_IPV6 %q", got)
	}
	// Listeners without a host accept both families.
	for _, k := range []string{"METRICS_ADDR", "READINESS_ADDR"} {
		if got := r.ConfigMap.Data[k]; !strings.HasPrefix(got, ":") {
			t.Errorf("%s %q binds one address family", k, got)
		}
	}
}

func TestCNIDisabled(t *testing.T) {
	r := mustRender(t, renderOpts{set: []string{"cni.enabled=false"}})
	node := container(t, r.DaemonSet, "node-setup")
	if v, _ := env(node, "CNI_ENABLED"); v != "false" {
		t.Errorf("CNI_ENABLED %q", v)
	}
	if node.ReadinessProbe != nil {
		t.Error("node-setup checks a CNI install that is off")
	}
	if got := r.ConfigMap.Data["CNI_SOCKET"]; got != "" {
		t.Errorf("CNI_SOCKET %q with the plugin off, want empty (no CNI server)", got)
	}
	for _, v := range r.DaemonSet.Spec.Template.Spec.Volumes {
		if v.Name == "cni-bin" || v.Name == "cni-conf" {
			t.Errorf("volume %s with the CNI plugin off", v.Name)
		}
	}
	// The clean-up on deletion stays: it also removes the BPF state.
	if !slices.Equal(node.Command, []string{"redirector-node", "watch"}) {
		t.Errorf("node-setup runs %v", node.Command)
	}
}

func TestCNISettings(t *testing.T) {
	r := mustRender(t, renderOpts{set: []string{
		"cni.binDir=/home/kubernetes/bin", "cni.confDir=/var/lib/rancher/k3s/agent/etc/cni/net.d",
		"cni.confName=10-flannel.conflist", "cni.socketDir=/run/redirector/", "cni.checkInterval=3",
	}})
	ds := r.DaemonSet
	if v := volume(t, ds, "cni-bin"); v.HostPath.Path != "/home/kubernetes/bin" {
		t.Errorf("cni-bin hostPath %s", v.HostPath.Path)
	}
	if v := volume(t, ds, "cni-conf"); v.HostPath.Path != "/var/lib/rancher/k3s/agent/etc/cni/net.d" {
		t.Errorf("cni-conf hostPath %s", v.HostPath.Path)
	}
	if v := volume(t, ds, "socket-dir"); v.HostPath.Path != "/run/redirector/" {
		t.Errorf("socket-dir hostPath %s", v.HostPath.Path)
	}
	node := container(t, ds, "node-setup")
	for k, want := range map[string]string{
		"CNI_CONF_NAME": "10-flannel.conflist", "CNI_CHECK_INTERVAL": "3",
		"PLUGIN_AGENT_SOCKET": "/run/redirector/cni.sock", "PLUGIN_SELECTION_HINT": "/run/redirector/ambient-namespaces.json",
		// In-container paths stay fixed whatever the host's are.
		"CNI_BIN_DIR": "/host/opt/cni/bin", "CNI_CONF_DIR": "/host/etc/cni/net.d",
		"DAEMONSET_NAME": ds.Name,
	} {
		if got, _ := env(node, k); got != want {
			t.Errorf("node-setup %s=%q, want %q", k, got, want)
		}
	}
	if node.ReadinessProbe == nil || node.ReadinessProbe.Exec == nil ||
		!slices.Equal(node.ReadinessProbe.Exec.Command, []string{"redirector-node", "check-cni"}) {
		t.Errorf("node-setup readiness %+v, want redirector-node check-cni", node.ReadinessProbe)
	}
}

func TestConfigChecksumFollowsSettings(t *testing.T) {
	a := mustRender(t, renderOpts{}).DaemonSet.Spec.Template.Annotations["checksum/config"]
	b := mustRender(t, renderOpts{set: []string{"logLevel=debug"}}).DaemonSet.Spec.Template.Annotations["checksum/config"]
	if a == b {
		t.Error("changing a setting leaves checksum/config alone: the pods would not restart")
	}
}

func TestImage(t *testing.T) {
	for _, tc := range []struct {
		set  []string
		want string
	}{
		{nil, "ghcr.io/redirector-mesh/redirector:0.1.0"},
		{[]string{"image.tag=v9"}, "ghcr.io/redirector-mesh/redirector:v9"},
		{[]string{"image.tag=v9", "image.digest=sha256:abc"}, "ghcr.io/redirector-mesh/redirector@sha256:abc"},
	} {
		ds := mustRender(t, renderOpts{set: tc.set}).DaemonSet
		for _, c := range slices.Concat(ds.Spec.Template.Spec.InitContainers, ds.Spec.Template.Spec.Containers) {
			if c.Image != tc.want {
				t.Errorf("--set %v: %s image %q, want %q", tc.set, c.Image, c.Name, tc.want)
			}
		}
	}
}

// TestHelmLint runs `helm lint --strict` on every profile: no errors, no warnings.
func TestHelmLint(t *testing.T) {
	for _, p := range profiles(t) {
		vals := map[string]any{"profile": p}
		if p == "strict" {
			// Lint cannot pass --api-versions; lint the same templates with the mode off.
			vals["meshMTLSMode"] = ""
		}
		lint := action.NewLint()
		lint.Strict = true
		lint.Namespace = releaseNamespace
		res := lint.Run([]string{chartDir}, vals)
		for _, e := range res.Errors {
			t.Errorf("profile %s: lint: %v", p, e)
		}
		for _, m := range res.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("profile %s: lint: %s", p, m)
			}
		}
	}
}
