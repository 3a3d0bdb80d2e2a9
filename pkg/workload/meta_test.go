package workload

import (
	"testing"

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
			map[string]string{"app": "reviews", "pod-template-hash": "5b8d7c9f6"}), "reviews-v2", "Deployment", TypeDeployment},
		{"replicaset without the hash", owned("rs-abcde", "rs-", "ReplicaSet", "rs", nil), "rs", "ReplicaSet", TypePod},
		{"statefulset", owned("db-0", "db-", "StatefulSet", "db", map[string]string{"app": "db"}), "db", "StatefulSet", TypePod},
		{"daemonset", owned("agent-x7k2p", "agent-", "DaemonSet", "agent", nil), "agent", "DaemonSet", TypePod},
		{"job", owned("migrate-q8w2z", "migrate-", "Job", "migrate", nil), "migrate", "Job", TypeJob},
		{"cronjob", owned("backup-28391040-abcde", "backup-28391040-", "Job", "backup-28391040", nil), "backup", "CronJob", TypeCronJob},
		{"bare pod", owned("client", "", "", "", map[string]string{"app": "client"}), "client", "Pod", TypePod},
		{"owner but no generated name", owned("fixed", "", "ReplicaSet", "fixed-rs", nil), "fixed", "Pod", TypePod},
		{"override label", owned("x-1", "x-", "StatefulSet", "x", map[string]string{LabelWorkloadName: "named"}), "named", "StatefulSet", TypePod},
	} {
		name, kind, ty := WorkloadMeta(tc.pod)
		if name != tc.name || kind != tc.kind || ty != tc.ty {
			t.Errorf("%s: got %s/%s/%s, want %s/%s/%s", tc.desc, name, kind, ty, tc.name, tc.kind, tc.ty)
		}
	}
}

func TestCanonicalService(t *testing.T) {
	for _, tc := range []struct {
		labels         map[string]string
		name, revision string
	}{
		{map[string]string{"app": "reviews", "version": "v2"}, "reviews", "v2"},
		{map[string]string{"app.kubernetes.io/name": "kname", "app": "reviews", "app.kubernetes.io/version": "1.2", "version": "v2"}, "kname", "1.2"},
		{map[string]string{LabelCanonicalName: "canon", LabelCanonicalRevision: "r1", "app": "reviews", "version": "v2"}, "canon", "r1"},
		{nil, "reviews-v2", "latest"},
	} {
		name, rev := CanonicalService(tc.labels, "reviews-v2")
		if name != tc.name || rev != tc.revision {
			t.Errorf("%v: got %s %s, want %s %s", tc.labels, name, rev, tc.name, tc.revision)
		}
	}
}
