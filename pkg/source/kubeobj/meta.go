package kubeobj

import (
	"regexp"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/redirector-mesh/redirector/pkg/workload"
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
	if v, ok := pod.Labels[workload.LabelWorkloadName]; ok {
		name = v
	}
	switch kind {
	case "Deployment":
		typ = workload.TypeDeployment
	case "CronJob":
		typ = workload.TypeCronJob
	case "Job":
		typ = workload.TypeJob
	default:
		typ = workload.TypePod
	}
	return name, kind, typ
}
