package main

import (
	"os"
	"os/exec"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// machine is what the numbers were measured on.
type machine struct {
	CPU    string `json:"cpu"`
	CPUs   int    `json:"cpus"`
	Kernel string `json:"kernel"`
	Go     string `json:"go"`
	Iperf3 string `json:"iperf3"`
	Fortio string `json:"fortio"`
	// Congestion is the machine's default TCP congestion control, which the
	// suite's namespaces inherit unless --congestion says otherwise.
	Congestion string `json:"congestion"`
}

func machineInfo(cfg config) machine {
	m := machine{CPUs: runtime.NumCPU(), Go: runtime.Version()}
	if raw, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(raw), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	firstLine := func(name string, args ...string) string {
		out, _ := exec.Command(name, args...).CombinedOutput()
		l, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
		return l
	}
	if raw, err := os.ReadFile("/proc/sys/net/ipv4/tcp_congestion_control"); err == nil {
		m.Congestion = strings.TrimSpace(string(raw))
	}
	m.Iperf3 = firstLine("iperf3", "--version")
	m.Fortio = firstLine(cfg.Fortio, "version")
	return m
}
