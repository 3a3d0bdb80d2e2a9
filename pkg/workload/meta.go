package workload

import (
	"regexp"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

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

// cronJobName matches the "-<8 to 10 digit schedule time>" suffix a CronJob
// gives its Jobs.
var cronJobName = regexp.MustCompile(`^(.+)-\d{8,10}$`)

// WorkloadMeta derives the pod's workload name, the owner's kind and
// ztunnel's workload type. A pod with a generated name is named by its
// controller: a ReplicaSet whose name ends in the pod-template-hash is its
// Deployment, one ending in the rollouts hash its Argo Rollout, a Job with
// a timestamp suffix its CronJob, a ReplicationController with a
// deploymentconfig label that DeploymentConfig, anything else (StatefulSet,
// DaemonSet, Job) the controller itself. A pod without one is its own
// workload. The service.istio.io/workload-name label overrides the name.
func WorkloadMeta(pod *corev1.Pod) (name, kind, typ string) {
	name, kind = pod.Name, "Pod"
	if pod.GenerateName != "" {
		for _, ref := range pod.OwnerReferences {
			if ref.Controller == nil || !*ref.Controller {
				continue
			}
			name, kind = ref.Name, ref.Kind
			hash, rollout := pod.Labels["pod-template-hash"], pod.Labels["rollouts-pod-template-hash"]
			switch {
			case kind == "ReplicaSet" && hash != "" && strings.HasSuffix(ref.Name, hash):
				name, kind = strings.TrimSuffix(ref.Name, "-"+hash), "Deployment"
			case kind == "ReplicaSet" && rollout != "" && strings.HasSuffix(ref.Name, rollout):
				name, kind = strings.TrimSuffix(ref.Name, "-"+rollout), "Rollout"
			case kind == "ReplicationController" && pod.Labels["deploymentconfig"] != "":
				name, kind = pod.Labels["deploymentconfig"], "DeploymentConfig"
			case kind == "Job":
				if m := cronJobName.FindStringSubmatch(ref.Name); m != nil {
					name, kind = m[1], "CronJob"
				}
			}
			break
		}
	}
	if name == "" {
		name = pod.Name
	}
	if v, ok := pod.Labels[LabelWorkloadName]; ok {
		name = v
	}
	switch kind {
	case "Deployment":
		typ = TypeDeployment
	case "CronJob":
		typ = TypeCronJob
	case "Job":
		typ = TypeJob
	default:
		typ = TypePod
	}
	return name, kind, typ
}

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
