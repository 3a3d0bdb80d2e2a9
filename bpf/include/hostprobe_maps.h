/* BTF-defined maps of the host-probe programs, pinned by name under the same
 * pin root as the pod-side maps. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "hostprobe_types.h"

/* The enrollment map of the pod-side programs (maps.h), declared again with
 * the same type, key, value, size and pinning so that loading this object
 * reuses the pinned map: a pod's addresses are SNAT targets exactly while
 * they are enrolled. pkg/probe tests that both declarations agree. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct pod_addr);
	__type(value, struct pod_settings);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_pods SEC(".maps");

/* The reason counters of the pod-side programs (maps.h), shared the same
 * way: the host programs count their drops there too. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, REASON_SLOTS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_reasons SEC(".maps");

/* SNATed connections, so replies find the node address back. LRU: bounded,
 * the least recently used connection is forgotten first. The size is set
 * from Go before loading. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct nat_key);
	__type(value, struct nat_entry);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_probe_nat SEC(".maps");

/* Pod id -> per-CPU counters. Created by pkg/probe when it attaches to the
 * pod's host veth, deleted on detach. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct snat_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_probe_stats SEC(".maps");

/* Host veth ifindex -> the pod id attached there. Written by pkg/probe when it
 * attaches to the pod's host veth, deleted on detach, rebuilt from the pinned
 * links at load. A SYN starts SNAT only on its destination pod's own veth:
 * a bridge that forgot where the pod is floods the node's SYN to every port,
 * and only one copy is the pod's. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_probe_veths SEC(".maps");
