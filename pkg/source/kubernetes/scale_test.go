package kubernetes_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	k8s "k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
	"github.com/redirector-mesh/redirector/test/kubetest"
)

// The scale benchmark (issue 17): a real API server holding 20k pods, 2k services and 20k
// endpoints (2k EndpointSlices of 10), 100 of the pods on the agent's node. It measures the
// agent's Kubernetes source in a child process of its own (this test binary again, running
// BenchmarkScaleAgent), so the memory is the source's and not the loader's: heap in use after GC
// and RSS once the first snapshot is a directory, and the time from a change (a pod's label,
// a new pod, a new pod's IP) to a directory holding it, as the agent builds one per snapshot.
// With REDIRECTOR_K8S_SCALE_OLD naming a test binary built from an older source (see
// BENCHMARKS.md), that one is measured too, against the same objects.
const (
	// envScale runs BenchmarkKubernetesSourceScale: 1 is the full size, a fraction (0.1) a smaller cluster.
	envScale = "REDIRECTOR_K8S_SCALE"
	// envScaleOld names a test binary of an older source to measure as well.
	envScaleOld = "REDIRECTOR_K8S_SCALE_OLD"
	// envScaleAgent, set by BenchmarkKubernetesSourceScale for its children, is the kubeconfig BenchmarkScaleAgent uses.
	envScaleAgent = "REDIRECTOR_K8S_SCALE_AGENT"
	// envScaleRun names the child's run, so the pods it creates do not collide.
	envScaleRun = "REDIRECTOR_K8S_SCALE_RUN"
	// envScaleChanges is how many changes of each kind the child measures.
	envScaleChanges = "REDIRECTOR_K8S_SCALE_CHANGES"
	// envScalePods is the number of pods the child waits for in its first directory.
	envScalePods = "REDIRECTOR_K8S_SCALE_PODS"
)

const (
	scaleNode       = "node-a"
	scaleNamespaces = 20
	scaleNodes      = 200 // so 1 pod in 200 is on scaleNode
	scalePerService = 10  // pods (and endpoints) per service
)

// scaleResult is what a child reports.
type scaleResult struct {
	Pods            int     `json:"pods"`
	Services        int     `json:"services"`
	LocalPods       int     `json:"localPods"`
	SyncSeconds     float64 `json:"syncSeconds"`
	BaselineHeapMiB float64 `json:"baselineHeapMiB"`
	BaselineRSSMiB  float64 `json:"baselineRssMiB"`
	HeapInuseMiB    float64 `json:"heapInuseMiB"`
	RSSMiB          float64 `json:"rssMiB"`
	PeakRSSMiB      float64 `json:"peakRssMiB"`
	// Latencies are by kind of change: label, newPod, podIP.
	Latencies           map[string]latency
	CPUPerChangeMs      float64 `json:"cpuPerChangeMs"`
	DirectoryBuildMsP50 float64 `json:"directoryBuildMsP50"`
}

// latency summarises N measured changes, in milliseconds.
type latency struct {
	N             int
	P50, P99, Max float64
	Snapshots     int // snapshots delivered while measuring
}

func BenchmarkKubernetesSourceScale(t *testing.B) {
	factor, err := strconv.ParseFloat(os.Getenv(envScale), 64)
	if err != nil || factor <= 0 {
		// Minutes of loading: only on request (make bench's -bench . passes by).
		t.Skipf("set %s=1 to run the Kubernetes source scale benchmark (minutes; -benchtime 1x -timeout 60m)", envScale)
	}
	pods := int(20000 * factor)
	services := pods / scalePerService
	c := kubetest.Start(t)
	start := time.Now()
	scaleLoad(t, c.Config, pods, services)
	t.Logf("loaded %d pods, %d services, %d endpoints in %v", pods, services, services*scalePerService, time.Since(start).Round(time.Second))

	type run struct{ name, bin string }
	runs := []run{{"new", os.Args[0]}}
	if old := os.Getenv(envScaleOld); old != "" {
		runs = append([]run{{"old", old}}, runs...)
	}
	var report strings.Builder
	fmt.Fprintf(&report, "%d pods (%d on %s), %d services, %d endpoints; GOMAXPROCS %d\n",
		pods, pods/scaleNodes, scaleNode, services, services*scalePerService, runtime.GOMAXPROCS(0))
	var mem, lat strings.Builder
	fmt.Fprintf(&mem, "%-4s %7s %9s %8s %9s %9s %8s %7s\n", "run", "sync s", "heap MiB", "RSS MiB", "peak RSS", "idle RSS", "CPU/chg", "dir ms")
	fmt.Fprintf(&lat, "%-4s %-10s %-20s %-20s\n", "run", "change", "to snapshot p50/p99", "to directory p50/p99/max ms")
	for _, r := range runs {
		res := scaleRunAgent(t, r.bin, r.name, c.Kubeconfig, pods)
		fmt.Fprintf(&mem, "%-4s %7.1f %9.1f %8.1f %9.1f %9.1f %8.1f %7.1f\n", r.name, res.SyncSeconds, res.HeapInuseMiB,
			res.RSSMiB, res.PeakRSSMiB, res.BaselineRSSMiB, res.CPUPerChangeMs, res.DirectoryBuildMsP50)
		for _, k := range []string{"label", "newPod", "podIP"} {
			x, y := res.Latencies[k], res.Latencies[k+"Snapshot"]
			fmt.Fprintf(&lat, "%-4s %-10s %-20s %.0f / %.0f / %.0f (n=%d)\n", r.name, k, fmt.Sprintf("%.0f / %.0f", y.P50, y.P99), x.P50, x.P99, x.Max, x.N)
		}
	}
	report.WriteString(mem.String() + "\n" + lat.String())
	t.Log("\n" + report.String())
	fmt.Println(report.String())
}

// scaleRunAgent runs BenchmarkScaleAgent in bin against kubeconfig and returns its result.
func scaleRunAgent(t testing.TB, bin, name, kubeconfig string, pods int) scaleResult {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), bin, "-test.run=^$", "-test.bench=^BenchmarkScaleAgent$", "-test.benchtime=1x", "-test.count=1", "-test.timeout=30m")
	cmd.Env = append(os.Environ(), envScaleAgent+"="+kubeconfig, envScaleRun+"="+name, envScalePods+"="+strconv.Itoa(pods))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var res *scaleResult
	sc := bufio.NewScanner(bytes.NewReader(out.Bytes()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if line, ok := strings.CutPrefix(sc.Text(), "SCALE_RESULT "); ok {
			res = new(scaleResult)
			if jerr := json.Unmarshal([]byte(line), res); jerr != nil {
				t.Fatalf("%s: parse result: %v", name, jerr)
			}
		}
	}
	if err != nil || res == nil {
		t.Fatalf("%s agent (%s): %v\n%s", name, bin, err, out.String())
	}
	return *res
}

// BenchmarkScaleAgent is BenchmarkKubernetesSourceScale's child: the agent's source against
// the loaded API server. A benchmark, not a test, so that no test is ever skipped.
func BenchmarkScaleAgent(t *testing.B) {
	kubeconfig := os.Getenv(envScaleAgent)
	if kubeconfig == "" {
		t.Skip("run by BenchmarkKubernetesSourceScale")
	}
	run := os.Getenv(envScaleRun)
	wantPods, _ := strconv.Atoi(os.Getenv(envScalePods))
	changes := 100
	if n, err := strconv.Atoi(os.Getenv(envScaleChanges)); err == nil && n > 0 {
		changes = n
	}
	ctx := t.Context()
	// As the agent: a kubeconfig's settings (client-go's default QPS), protobuf set by the source.
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	// Changes go through a client of their own, unthrottled.
	wc := rest.CopyConfig(rc)
	wc.QPS, wc.Burst = 1000, 1000
	client, err := k8s.NewForConfig(wc)
	if err != nil {
		t.Fatal(err)
	}

	var res scaleResult
	res.BaselineHeapMiB, res.BaselineRSSMiB, _ = scaleMemory()

	type dirAt struct {
		dir      *workload.Directory
		snap, at time.Time // when the snapshot arrived, when its directory was built
		seq      int
	}
	var (
		latest    atomic.Pointer[dirAt]
		seq       atomic.Int64
		buildMu   sync.Mutex
		buildTook []float64
	)
	updated := make(chan struct{}, 1)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	src, err := newScaleSource(rc, scaleNode, selection.Config{ExcludeNamespaces: []string{"kube-system"}}, log)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		done <- src.Run(runCtx, func(s source.Snapshot) {
			// What the agent does with every snapshot: index it.
			t0 := time.Now()
			d, _ := workload.NewDirectory(s.Workloads, s.Services)
			now := time.Now()
			buildMu.Lock()
			buildTook = append(buildTook, ms(now.Sub(t0)))
			buildMu.Unlock()
			latest.Store(&dirAt{dir: d, snap: t0, at: now, seq: int(seq.Add(1))})
			select {
			case updated <- struct{}{}:
			default:
			}
		})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	// waitDir waits for a directory satisfying ok and returns it. Then it waits out the
	// debounce's minimum gap between snapshots (50 ms), so that each change measured is a
	// lone change, not one queued behind the previous snapshot.
	waitDir := func(what string, ok func(*workload.Directory) bool) *dirAt {
		defer time.Sleep(100 * time.Millisecond)
		deadline := time.After(2 * time.Minute)
		for {
			if d := latest.Load(); d != nil && ok(d.dir) {
				return d
			}
			select {
			case <-updated:
			case <-deadline:
				t.Fatalf("no directory with %s after 2m", what)
			}
		}
	}
	waitDir(fmt.Sprintf("%d pods", wantPods), func(d *workload.Directory) bool { return len(d.All()) >= wantPods })
	res.SyncSeconds = time.Since(start).Seconds()
	d := latest.Load().dir
	res.Pods, res.Services = len(d.All()), len(d.Services())
	local := d.LocalPods(scaleNode)
	res.LocalPods = len(local)
	time.Sleep(2 * time.Second) // let the informers settle
	res.HeapInuseMiB, res.RSSMiB, res.PeakRSSMiB = scaleMemory()

	res.Latencies = map[string]latency{}
	cpu0 := scaleCPU()
	// A label change of a local pod.
	var lat, latSnap []float64
	first := latest.Load().seq
	for i := range changes {
		w := local[i%len(local)]
		value := fmt.Sprintf("%s-%d", run, i)
		patch := fmt.Sprintf(`{"metadata":{"labels":{"scale-rev":%q}}}`, value)
		t0 := time.Now()
		if _, err := client.CoreV1().Pods(w.Namespace).Patch(ctx, w.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		d := waitDir("label "+value, func(d *workload.Directory) bool {
			p, ok := d.Pod(w.Namespace, w.Name)
			return ok && p.Labels["scale-rev"] == value
		})
		lat, latSnap = append(lat, ms(d.at.Sub(t0))), append(latSnap, ms(d.snap.Sub(t0)))
	}
	res.Latencies["label"] = summarise(lat, latest.Load().seq-first)
	res.Latencies["labelSnapshot"] = summarise(latSnap, 0)

	// A new pod on this node: from its creation to its workload, then from its IP (the
	// kubelet's status update) to the directory finding it by address, enrolled.
	var newLat, ipLat, newSnap, ipSnap []float64
	first = latest.Load().seq
	var created []*corev1.Pod
	for i := range changes {
		idx := 1_000_000 + i
		p := scalePod(idx, 0, scaleNode) // namespace ns-00 is ambient
		p.Name = fmt.Sprintf("scale-%s-%d", run, i)
		t0 := time.Now()
		p, err := client.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		created = append(created, p)
		d := waitDir("new pod "+p.Name, func(d *workload.Directory) bool { _, ok := d.Pod(p.Namespace, p.Name); return ok })
		newLat, newSnap = append(newLat, ms(d.at.Sub(t0))), append(newSnap, ms(d.snap.Sub(t0)))

		ip := scaleIP(idx)
		scaleStatus(p, ip)
		t0 = time.Now()
		if _, err := client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		d = waitDir("IP of "+p.Name, func(d *workload.Directory) bool {
			w, ok := d.ByAddr(ip)
			return ok && w.Name == p.Name && w.Enrolled
		})
		ipLat, ipSnap = append(ipLat, ms(d.at.Sub(t0))), append(ipSnap, ms(d.snap.Sub(t0)))
	}
	snaps := latest.Load().seq - first
	res.Latencies["newPod"] = summarise(newLat, snaps)
	res.Latencies["podIP"] = summarise(ipLat, snaps)
	res.Latencies["newPodSnapshot"] = summarise(newSnap, 0)
	res.Latencies["podIPSnapshot"] = summarise(ipSnap, 0)
	res.CPUPerChangeMs = (scaleCPU() - cpu0).Seconds() * 1000 / float64(3*changes)
	buildMu.Lock()
	res.DirectoryBuildMsP50 = summarise(buildTook, 0).P50
	buildMu.Unlock()

	for _, p := range created {
		_ = client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	}
	b, _ := json.Marshal(res)
	fmt.Println("SCALE_RESULT " + string(b))
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func summarise(samples []float64, snapshots int) latency {
	if len(samples) == 0 {
		return latency{}
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	at := func(q float64) float64 { return s[min(len(s)-1, int(q*float64(len(s))))] }
	return latency{N: len(s), P50: at(0.5), P99: at(0.99), Max: s[len(s)-1], Snapshots: snapshots}
}

// scaleMemory returns heap in use after a GC, RSS and peak RSS, in MiB.
func scaleMemory() (heap, rss, peak float64) {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heap = float64(ms.HeapInuse) / (1 << 20)
	status, _ := os.ReadFile("/proc/self/status")
	for line := range strings.SplitSeq(string(status), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		kb, _ := strconv.ParseFloat(f[1], 64)
		switch f[0] {
		case "VmRSS:":
			rss = kb / 1024
		case "VmHWM:":
			peak = kb / 1024
		}
	}
	return heap, rss, peak
}

// scaleCPU is the process's CPU time so far (user and system).
func scaleCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// scaleLoad creates the cluster: namespaces (every other one ambient), services, pods (with
// their status, as a kubelet writes it) and one EndpointSlice per service, through a bounded
// pool of workers.
func scaleLoad(t testing.TB, cfg *rest.Config, pods, services int) {
	t.Helper()
	rc := rest.CopyConfig(cfg)
	rc.QPS, rc.Burst = 5000, 5000
	rc.ContentType = "application/vnd.kubernetes.protobuf"
	client, err := k8s.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	for n := range scaleNamespaces {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: scaleNamespace(n), Labels: map[string]string{"team": fmt.Sprint(n)}}}
		if n%2 == 0 {
			ns.Labels[selection.DataplaneModeLabel] = selection.DataplaneModeAmbient
		}
		if _, err := client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	pool := func(n int, job func(i int) error) {
		var (
			wg    sync.WaitGroup
			next  atomic.Int64
			first atomic.Pointer[error]
		)
		for range 32 {
			wg.Go(func() {
				for {
					i := int(next.Add(1)) - 1
					if i >= n || first.Load() != nil {
						return
					}
					if err := job(i); err != nil {
						first.CompareAndSwap(nil, &err)
					}
				}
			})
		}
		wg.Wait()
		if err := first.Load(); err != nil {
			t.Fatal(*err)
		}
	}
	pool(services, func(j int) error {
		_, err := client.CoreV1().Services(scaleNamespace(j)).Create(ctx, scaleService(j), metav1.CreateOptions{})
		return err
	})
	pool(pods, func(i int) error {
		node := fmt.Sprintf("node-%03d", i%scaleNodes)
		if i%scaleNodes == 0 {
			node = scaleNode
		}
		p, err := client.CoreV1().Pods(scaleNamespace(i/scalePerService)).Create(ctx, scalePod(i, i/scalePerService, node), metav1.CreateOptions{})
		if err != nil {
			return err
		}
		scaleStatus(p, scaleIP(i))
		_, err = client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
		return err
	})
	pool(services, func(j int) error {
		_, err := client.DiscoveryV1().EndpointSlices(scaleNamespace(j)).Create(ctx, scaleSlice(j), metav1.CreateOptions{})
		return err
	})
}

func scaleNamespace(service int) string { return fmt.Sprintf("ns-%02d", service%scaleNamespaces) }

// scaleIP is pod i's address.
func scaleIP(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, byte(128 + i>>16), byte(i >> 8), byte(i)})
}

// scalePod is pod i of service j's Deployment, as a real one looks (containers, probes,
// volumes, tolerations), so the API objects have a realistic size.
func scalePod(i, j int, node string) *corev1.Pod {
	app := fmt.Sprintf("svc-%04d", j)
	hash := "5b8d7c9f6"
	rs := app + "-" + hash
	yes := true
	cpu, mem := resource.MustParse("100m"), resource.MustParse("128Mi")
	probe := &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromString("http")}},
		PeriodSeconds: 10, FailureThreshold: 3}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: scaleNamespace(j), Name: fmt.Sprintf("%s-%05d", rs, i), GenerateName: rs + "-",
			Labels: map[string]string{"app": app, "version": "v1", "pod-template-hash": hash,
				"app.kubernetes.io/name": app, "app.kubernetes.io/part-of": "bench"},
			Annotations: map[string]string{"prometheus.io/scrape": "true", "prometheus.io/port": "9090",
				"kubectl.kubernetes.io/restartedAt": "2026-12-01T10:00:00Z"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: rs,
				UID: types.UID(fmt.Sprintf("00000000-0000-0000-0000-%012d", j)), Controller: &yes, BlockOwnerDeletion: &yes}},
		},
		Spec: corev1.PodSpec{
			NodeName: node, ServiceAccountName: app,
			Containers: []corev1.Container{
				{
					Name: "app", Image: "registry.example.com/bench/" + app + ":v1.2.3",
					Args: []string{"--port=8080", "--metrics-port=9090", "--log-level=info"},
					Env: []corev1.EnvVar{{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
						{Name: "POD_NAMESPACE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.namespace"}}},
						{Name: "GOMAXPROCS", Value: "2"}, {Name: "FEATURE_X", Value: "on"}},
					Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP},
						{Name: "metrics", ContainerPort: 9090, Protocol: corev1.ProtocolTCP}},
					Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: cpu, corev1.ResourceMemory: mem},
						Limits: corev1.ResourceList{corev1.ResourceMemory: mem}},
					LivenessProbe: probe, ReadinessProbe: probe,
					VolumeMounts: []corev1.VolumeMount{{Name: "config", MountPath: "/etc/app"},
						{Name: "kube-api-access", MountPath: "/var/run/secrets/kubernetes.io/serviceaccount", ReadOnly: true}},
				},
				{
					Name: "log-shipper", Image: "registry.example.com/infra/shipper:2.0",
					Resources:    corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: cpu}},
					VolumeMounts: []corev1.VolumeMount{{Name: "kube-api-access", MountPath: "/var/run/secrets/kubernetes.io/serviceaccount", ReadOnly: true}},
				},
			},
			Volumes: []corev1.Volume{
				{Name: "config", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: app}}}},
				{Name: "kube-api-access", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{Sources: []corev1.VolumeProjection{
					{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Path: "token", ExpirationSeconds: new(int64(3607))}},
					{ConfigMap: &corev1.ConfigMapProjection{LocalObjectReference: corev1.LocalObjectReference{Name: "kube-root-ca.crt"},
						Items: []corev1.KeyToPath{{Key: "ca.crt", Path: "ca.crt"}}}},
				}}}},
			},
			Tolerations: []corev1.Toleration{
				{Key: "node.kubernetes.io/not-ready", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: new(int64(300))},
				{Key: "node.kubernetes.io/unreachable", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: new(int64(300))},
			},
		},
	}
}

// scaleStatus is what the kubelet reports for a running pod at ip.
func scaleStatus(p *corev1.Pod, ip netip.Addr) {
	now := metav1.NewTime(time.Unix(1764583200, 0))
	p.Status.Phase = corev1.PodRunning
	p.Status.HostIP = "192.168.0.1"
	p.Status.HostIPs = []corev1.HostIP{{IP: "192.168.0.1"}}
	p.Status.PodIP = ip.String()
	p.Status.PodIPs = []corev1.PodIP{{IP: ip.String()}}
	p.Status.StartTime = &now
	for _, c := range []corev1.PodConditionType{corev1.PodReadyToStartContainers, corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady, corev1.PodScheduled} {
		p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: c, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	for _, c := range p.Spec.Containers {
		p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, ImageID: c.Image + "@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
			ContainerID: "containerd://0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
			Ready:       true, Started: new(true), State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
		})
	}
}

// scaleService is service j: ports http and metrics, selecting its Deployment's pods.
func scaleService(j int) *corev1.Service {
	app := fmt.Sprintf("svc-%04d", j)
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: scaleNamespace(j), Name: app, Labels: map[string]string{"app": app}},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": app}, Ports: []corev1.ServicePort{
			{Name: "http", Port: 80, TargetPort: intstr.FromString("http")},
			{Name: "metrics", Port: 9090, TargetPort: intstr.FromInt32(9090)},
		}},
	}
}

// scaleSlice is service j's EndpointSlice: its scalePerService pods, as the EndpointSlice
// controller writes it.
func scaleSlice(j int) *discoveryv1.EndpointSlice {
	app := fmt.Sprintf("svc-%04d", j)
	es := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: scaleNamespace(j), Name: app + "-x7k2p",
			Labels: map[string]string{discoveryv1.LabelServiceName: app, discoveryv1.LabelManagedBy: "endpointslice-controller.k8s.io"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports: []discoveryv1.EndpointPort{{Name: new("http"), Port: new(int32(8080)), Protocol: new(corev1.ProtocolTCP)},
			{Name: new("metrics"), Port: new(int32(9090)), Protocol: new(corev1.ProtocolTCP)}},
	}
	for k := range scalePerService {
		i := j*scalePerService + k
		node := fmt.Sprintf("node-%03d", i%scaleNodes)
		if i%scaleNodes == 0 {
			node = scaleNode
		}
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{scaleIP(i).String()},
			Conditions: discoveryv1.EndpointConditions{Ready: new(true), Serving: new(true), Terminating: new(false)},
			NodeName:   new(node), Zone: new("zone-a"),
			TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: scaleNamespace(j), Name: fmt.Sprintf("%s-5b8d7c9f6-%05d", app, i),
				UID: types.UID(fmt.Sprintf("00000000-0000-0000-0001-%012d", i))},
		})
	}
	return es
}
