// Package bpf holds the eBPF programs of the data path and the Go bindings
// bpf2go generates for them. The .o and _bpfel.go files are committed, so
// building and testing need no clang; `make generate` refreshes them.
package bpf

//go:generate go tool bpf2go -tags linux -cc clang -cflags "-O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu" -target bpfel -type pod_addr -type pod_settings -type pod_counters -type verdict_reason -type pod_flag -type pod_meta -type pod_netns -type attach_mode -type dialled_key Capture capture.c
//go:generate go tool bpf2go -tags linux -cc clang -cflags "-O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu" -target bpfel -type nat_key -type nat_entry -type snat_counters HostProbe hostprobe.c
//go:generate go tool bpf2go -tags linux -cc clang -cflags "-O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu" -target bpfel -type sock_key -type sock_state -type accel_counters Sockops sockops.c
