package workload

// Istio's telemetry names a pod by its workload (the Deployment, Job, ...
// that owns it) and by its canonical service and revision. Dashboards,
// Kiali's graph and ztunnel's metrics group by these, so the agent derives
// them exactly as Istio does (istio.io/istio pkg/kube GetWorkloadMetaFromPod
// and pkg/config/labels CanonicalService), not by a guess of its own.

// Labels Istio reads to name workloads and canonical services.
const (
	LabelWorkloadName      = "service.istio.io/workload-name"
	LabelCanonicalName     = "service.istio.io/canonical-name"
	LabelCanonicalRevision = "service.istio.io/canonical-revision"
)

// Workload types, as ztunnel's workload_type and its baggage's
// k8s.<type>.name key spell them.
const (
	TypeDeployment = "deployment"
	TypeCronJob    = "cronjob"
	TypeJob        = "job"
	TypePod        = "pod"
)

// CanonicalService is Istio's canonical service name and revision of a
// workload: the canonical-name label, else app.kubernetes.io/name, else
// app, else the workload name; the canonical-revision label, else
// app.kubernetes.io/version, else version, else "latest". As in Istio, a
// label that is present counts even when empty.
func CanonicalService(labels map[string]string, workloadName string) (name, revision string) {
	name, revision = workloadName, "latest"
	for _, k := range []string{LabelCanonicalName, "app.kubernetes.io/name", "app"} {
		if v, ok := labels[k]; ok {
			name = v
			break
		}
	}
	for _, k := range []string{LabelCanonicalRevision, "app.kubernetes.io/version", "version"} {
		if v, ok := labels[k]; ok {
			revision = v
			break
		}
	}
	return name, revision
}
