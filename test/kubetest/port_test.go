package kubetest

import (
	"net"
	"testing"

	"github.com/redirector-mesh/redirector/test/testbin"
)

// TestStartRetriesTakenPort: a port found free can be taken by a parallel
// test before etcd or kube-apiserver binds it, and the cluster failed to
// start ("bind: address already in use", seen in CI). Start now tries
// another port. Here every first pick of a port is one already taken.
func TestStartRetriesTakenPort(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	go func() { // answers nothing: a health check fails at once
		for {
			c, err := taken.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	takenPort := taken.Addr().(*net.TCPAddr).Port
	picks := 0
	freePort = func() (int, error) {
		picks++
		if picks == 2 || picks == 5 { // etcd's first peer port; kube-apiserver's first port
			return takenPort, nil
		}
		return testbin.FreePort()
	}
	defer func() { freePort = testbin.FreePort }()
	c := Start(t)
	if _, err := c.Client(t).Discovery().ServerVersion(); err != nil {
		t.Fatalf("the cluster started on other ports does not answer: %v", err)
	}
	if picks != 6 {
		t.Errorf("%d port picks, want 6 (etcd twice, two ports each; kube-apiserver twice)", picks)
	}
}
