/* Structs of the host-probe SNAT programs shared with Go (bpf2go -type).
 * The pod address and enrollment entry come from types.h. */
#pragma once

#include <linux/types.h>
#include "types.h"

/* Key of the probe NAT map: a SNATed connection as the pod's replies show it
 * (source pod:pod_port, destination SNAT address:node_port). The SNAT address
 * is fixed per family, and the family is the pod address's (IPv4-mapped or
 * not), so it is not part of the key. Ports in network order. */
struct nat_key {
	struct pod_addr pod;
	__be16 pod_port;
	__be16 node_port;
};

/* Value of the probe NAT map: the node's own source address the connection
 * had before SNAT, restored on the replies, the pod it was counted for, and
 * the host veth its SYN left by: only that veth's packets are the pod's
 * replies (another pod on the node's bridge can forge the pod's address). */
struct nat_entry {
	struct pod_addr node;
	__u32 pod_id;
	__u32 ifindex;
};

/* Per-pod counters of the host-probe programs (per-CPU, summed in Go). */
struct snat_counters {
	__u64 conns;          /* node connections SNATed (their SYNs) */
	__u64 snat_packets;   /* node -> pod packets whose source was rewritten */
	__u64 reply_packets;  /* pod -> node replies whose destination was restored */
	__u64 tunnel_marked;  /* node SYNs to the pod left alone for the tunnel mark */
	__u64 errors;         /* packets dropped because a rewrite failed */
};
