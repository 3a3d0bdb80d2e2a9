/* BTF-defined maps of the pod-side programs, pinned by name under the pin root
 * so a restarted agent and bpftool see the same objects. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "types.h"

#define MAX_PODS 4096

/* Pod address -> settings. Written by the loader; read on every packet. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PODS);
	__type(key, struct pod_addr);
	__type(value, struct pod_settings);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_pods SEC(".maps");

/* Pod address -> per-CPU counters. Created with the enrollment entry. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, MAX_PODS);
	__type(key, struct pod_addr);
	__type(value, struct pod_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_pod_stats SEC(".maps");

/* enum verdict_reason -> per-CPU packet count, over all pods. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, REASON_SLOTS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_reasons SEC(".maps");

/* Inode number of a pod's network namespace -> the enrolled pod whose
 * interface there the programs are attached to. Written by the loader with
 * the enrollment entries, removed with them. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PODS);
	__type(key, __u32);
	__type(value, struct pod_netns);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_pod_netns SEC(".maps");

/* Pod id -> what was attached (struct pod_meta). Bookkeeping for the loader
 * and the inspect CLI; no program reads it. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PODS);
	__type(key, __u32);
	__type(value, struct pod_meta);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_pod_meta SEC(".maps");
