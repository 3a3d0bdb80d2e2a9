package kubeobj

import (
	"testing"

	"github.com/redirector-mesh/redirector/pkg/workload"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestWorkloadMeta(t *testing.T) {
	yes := true
	owned := func(name, gen, kind, owner string, labels map[string]string) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, GenerateName: gen, Labels: labels}}
		if owner != "" {
			p.OwnerReferences = []metav1.OwnerReference{{Kind: kind, Name: owner, Controller: &yes}}
		}
		return p
	}
	for _, tc := range []struct {
		desc           string
		pod            *corev1.Pod
		name, kind, ty string
	}{
		{"deployment", owned("reviews-v2-5b8d7c9f6-x2x9q", "reviews-v2-5b8d7c9f6-", "ReplicaSet", "reviews-v2-5b8d7c9f6",
			map[string]string{"app": "reviews", "pod-template-hash": "5b8d7c9f6"}), "reviews-v2", "Deployment", workload.TypeDeployment},
		{"replicaset without the hash", owned("rs-abcde", "rs-", "ReplicaSet", "rs", nil), "rs", "ReplicaSet", workload.TypePod},
		{"statefulset", owned("db-0", "db-", "StatefulSet", "db", map[string]string{"app": "db"}), "db", "StatefulSet", workload.TypePod},
		{"daemonset", owned("agent-x7k2p", "agent-", "DaemonSet", "agent", nil), "agent", "DaemonSet", workload.TypePod},
		{"job", owned("migrate-q8w2z", "migrate-", "Job", "migrate", nil), "migrate", "Job", workload.TypeJob},
		{"cronjob", owned("backup-28391040-abcde", "backup-28391040-", "Job", "backup-28391040", nil), "backup", "CronJob", workload.TypeCronJob},
		{"bare pod", owned("client", "", "", "", map[string]string{"app": "client"}), "client", "Pod", workload.TypePod},
		{"owner but no generated name", owned("fixed", "", "ReplicaSet", "fixed-rs", nil), "fixed", "Pod", workload.TypePod},
		{"override label", owned("x-1", "x-", "StatefulSet", "x", map[string]string{workload.LabelWorkloadName: "named"}), "named", "StatefulSet", workload.TypePod},
	} {
		name, kind, ty := WorkloadMeta(tc.pod)
		if name != tc.name || kind != tc.kind || ty != tc.ty {
			t.Errorf("%s: got %s/%s/%s, want %s/%s/%s", tc.desc, name, kind, ty, tc.name, tc.kind, tc.ty)
		}
	}
}
