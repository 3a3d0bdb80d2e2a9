package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// clockTicks is USER_HZ, the unit of utime and stime in /proc/<pid>/stat:
// 100 on every Linux architecture Go supports.
const clockTicks = 100

// agentPID finds the `redirector run` process that uses bpfRoot: the harness
// does not export its process, and the pin root is unique per agent.
func agentPID(bpfRoot string) (int, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		argv := strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
		if len(argv) < 2 || filepath.Base(argv[0]) != "redirector" || argv[1] != "run" {
			continue
		}
		for i := 2; i+1 < len(argv); i++ {
			if argv[i] == "--bpf-root" && argv[i+1] == bpfRoot {
				return pid, nil
			}
		}
	}
	return 0, fmt.Errorf("no redirector run process with --bpf-root %s", bpfRoot)
}

// cpuSeconds is the process's user + system CPU time so far, all threads.
func cpuSeconds(pid int) (float64, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("read CPU time of process %d: %w", pid, err)
	}
	// The command name (field 2) may hold spaces: fields are counted after
	// its closing parenthesis, starting with field 3 (state).
	i := bytes.LastIndexByte(raw, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(raw[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	utime, err1 := strconv.ParseUint(f[11], 10, 64) // field 14
	stime, err2 := strconv.ParseUint(f[12], 10, 64) // field 15
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: bad utime/stime %q %q", pid, f[11], f[12])
	}
	return float64(utime+stime) / clockTicks, nil
}

// cpuTotal is the summed CPU time of pids.
func cpuTotal(pids []int) (float64, error) {
	var sum float64
	for _, p := range pids {
		s, err := cpuSeconds(p)
		if err != nil {
			return 0, err
		}
		sum += s
	}
	return sum, nil
}

// rssMB is VmRSS from /proc/<pid>/status, in MiB.
func rssMB(pid int) (float64, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("read memory of process %d: %w", pid, err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/%d/status: VmRSS %q", pid, v)
			}
			return kb / 1024, nil
		}
	}
	return 0, fmt.Errorf("/proc/%d/status: no VmRSS", pid)
}

// runqWait is how long the threads of pids have waited on a run queue so
// far (the second field of each /proc/<pid>/task/<tid>/schedstat); threads
// that are gone or unreadable count nothing.
func runqWait(pids []int) time.Duration {
	var sum time.Duration
	for _, pid := range pids {
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		for _, t := range tasks {
			raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, t.Name()))
			if err != nil {
				continue
			}
			if f := strings.Fields(string(raw)); len(f) >= 2 {
				if ns, err := strconv.ParseInt(f[1], 10, 64); err == nil {
					sum += time.Duration(ns)
				}
			}
		}
	}
	return sum
}
