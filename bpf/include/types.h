/* Structs shared between the BPF programs and Go (exported with bpf2go -type).
 * Define a struct here once; never mirror it by hand in Go. */
#pragma once

#include <linux/types.h>

/* An address of an enrolled pod. IPv4 is stored IPv4-mapped (::ffff:a.b.c.d),
 * so one map serves both families. */
struct pod_addr {
	__u8 addr[16];
};

/* Per-pod settings flags. */
enum pod_flag {
	POD_CAPTURE_OUTBOUND = 1 << 0, /* steer the pod's outgoing TCP to 15001 */
	POD_CAPTURE_INBOUND = 1 << 1,  /* steer new plaintext TCP to the pod to 15006 */
	POD_CAPTURE_DNS = 1 << 2,      /* steer the pod's UDP queries to port 53 to the DNS socket on 15053 */
};

/* Value of the enrollment map: what to do for one pod address. The entry's
 * presence is the kill switch: without it, the programs pass everything. */
struct pod_settings {
	__u32 flags;   /* enum pod_flag bits */
	__u32 pod_id;  /* unique per node: tells whether two addresses belong to one pod */
};

/* Per-pod packet counters (per-CPU values, summed in Go). */
struct pod_counters {
	__u64 outbound_conns;   /* outbound SYNs steered to the outbound listener */
	__u64 inbound_conns;    /* inbound SYNs assigned to the inbound listener */
	__u64 steered_packets;  /* packets re-injected from egress to ingress */
	__u64 dropped_packets;  /* packets dropped to fail closed */
	__u64 bypassed_packets; /* enrolled-pod packets deliberately passed (probe, HBONE, tunnel) */
};

/* Reasons counted in the per-CPU reason array, for every enrolled pod. */
enum verdict_reason {
	REASON_OUT_SYN_STEERED = 0,  /* egress: new outbound connection re-injected */
	REASON_OUT_TUNNEL_SOCKET,    /* egress: packet of a tunnel-owned connection re-injected */
	REASON_OUT_PASS_TUNNEL_MARK, /* egress: sent by the tunnel itself */
	REASON_OUT_PASS_EXCLUDED,    /* egress: destination never captured (the probe address) */
	REASON_IN_ASSIGN_OUTBOUND,   /* ingress: re-injected SYN assigned to 15001 */
	REASON_IN_ASSIGN_INBOUND,    /* ingress: plaintext SYN assigned to 15006 */
	REASON_IN_PASS_HBONE,        /* ingress: to the HBONE port 15008 */
	REASON_IN_PASS_PROBE,        /* ingress: from the host-probe SNAT address */
	REASON_IN_PASS_REINJECTED,   /* ingress: re-injected packet of an existing connection */
	REASON_IN_PASS_EXISTING,     /* ingress: packet of a connection that already has a socket */
	REASON_IN_PASS_NO_CAPTURE,   /* ingress: inbound capture off for this pod */
	REASON_DROP_NO_LISTENER,     /* fail closed: the tunnel listener is missing */
	REASON_DROP_ASSIGN_FAILED,   /* fail closed: bpf_sk_assign refused */
	REASON_DROP_SPOOFED,         /* ingress: pod's own source address from the wire */
	REASON_DROP_TRUNCATED,       /* fail closed: IP packet that ends inside a header it needs (for a DNS-captured pod's UDP: the UDP header) */
	REASON_DROP_MALFORMED,       /* fail closed: header the kernel rejects (IHL or TCP offset < 5, wrong version), IPv4-mapped address in IPv6 */
	REASON_DROP_FRAGMENT,        /* fail closed: an IP fragment that may hold TCP, or the first fragment of a DNS-captured pod's UDP to port 53 */
	REASON_DROP_EXTHDR,          /* fail closed: IPv6 chain too long, or TCP hidden (ESP, IP-in-IP, GRE), or extension headers (AH) before a DNS-captured pod's UDP to port 53 */
	REASON_IN_SYN_TIMEWAIT,      /* ingress: a SYN's tuple was in TIME_WAIT: reset it, SYN queued again */
	REASON_DROP_SYN_TIMEWAIT,    /* fail closed: that TIME_WAIT socket could not be cleared */
	REASON_IN_SYN_EXISTING,      /* ingress: a SYN whose tuple has a live socket, left to TCP (retransmit, challenge ACK) */
	REASON_DROP_PROBE_SPOOFED,   /* host veth: to a pod from the probe SNAT address, not translated there; or a probe connection's packet the node did not send, or the probed pod's veth did not carry (another pod forging either end) */
	REASON_DROP_LINK_LOCAL,      /* fail closed: TCP to (ingress) or from (egress) a link-local address of an enrolled pod's interface; a DNS query from one, with DNS capture on */
	REASON_DROP_UNENROLLED_ADDR, /* fail closed: the same for any other address of that interface that is not enrolled (SLAAC, secondary) */
	REASON_DROP_VLAN,            /* fail closed: TCP, or a DNS-captured pod's UDP to port 53, in a frame still VLAN-tagged at tc (stacked 802.1Q/802.1ad/QinQ tags) */
	REASON_DROP_SYN_SENT,        /* fail closed: a SYN from the wire whose tuple is an app socket in SYN_SENT (a simultaneous open would connect it in plaintext) */
	REASON_DROP_SOURCE_ROUTE,    /* fail closed: IPv6 TCP, or a DNS-captured pod's UDP to port 53, with a routing header whose segments are not all visited (the destination is not the packet's own) */
	REASON_DROP_TUNNEL_GONE,     /* fail closed: egress packet of an app socket whose connection was captured, with no tunnel socket left for its tuple */
	REASON_DROP_CAPTURE_MARK,    /* fail closed: the app socket of a new outbound connection, or of a tunnel-owned packet, could not be marked as captured (no memory) */
	REASON_DROP_LOOPBACK,        /* fail closed: egress TCP, or a DNS-captured pod's UDP to port 53, to a loopback address on the pod's interface (a socket bound to the device) */
	REASON_SOCK_ROUTED_LOCAL,    /* sock_ops: an app socket of a connection the tunnel terminates got the reinject mark, so its packets take lo to the tunnel */
	REASON_DROP_FOREIGN_LISTENER, /* fail closed: the listener found for a captured SYN is not the tunnel's (no tunnel mark): a pod's own socket on the tunnel's port, bound to a more specific address; or a SYN-ACK from a pod with inbound capture that no tunnel socket sent (a member of the tunnel's reuseport group that is not the tunnel's) */
	REASON_DROP_FOREIGN_DST,     /* fail closed: a SYN from the wire to an enrolled address of another pod than the one whose interface it arrives on (the transparent inbound listener would take it) */
	REASON_IN_ASSIGN_COOKIE_ACK, /* ingress: an ACK from the wire whose tuple has no connection (a SYN cookie's) assigned to 15006, never to the app's listener */
	REASON_DROP_STEER,           /* fail closed: an egress packet to be steered could not be rewritten (no memory) */
	REASON_DROP_PROBE_UNMATCHED, /* host veth: from a pod to the probe SNAT address, answering no probe connection the NAT map knows (it would be routed off the node) */
	REASON_OUT_DNS_STEERED,      /* egress: a UDP query to port 53 of a pod with DNS capture re-injected */
	REASON_IN_ASSIGN_DNS,        /* ingress: re-injected DNS query assigned to the DNS socket (dns_port) */
	REASON_DROP_NO_DNS_SOCKET,   /* fail closed: a captured DNS query found no UDP socket on dns_port */
	REASON_DROP_FOREIGN_DNS_SOCKET, /* fail closed: the UDP socket found on dns_port is not the tunnel's (no tunnel mark) */
	REASON_DROP_IP_OPTIONS,      /* fail closed: a DNS query of a pod with DNS capture that carries IPv4 options (a source route would take it past the capture) */
	REASON_HOST_POD_NOT_PROBE,   /* host veth: a SYN to a pod from a socket of a process in the pods' cgroup (a hostNetwork pod), left untranslated: not a kubelet probe */
	REASON_DROP_FOREIGN_SRC,     /* fail closed: egress TCP SYN (or SYN-ACK), or a DNS-captured pod's UDP query to port 53, from an enrolled address of another pod than the one whose interface it leaves (IPV6_FREEBIND) */
	REASON_MAX,
};

/* Slots of the reason array: more than REASON_MAX so that adding a reason
 * keeps the pinned map compatible across an upgrade. */
#define REASON_SLOTS 64
_Static_assert(REASON_MAX <= REASON_SLOTS, "rd_reasons is too small for enum verdict_reason");

/* skb->hash of a SYN clear_timewait queued again (capture.c), so that it is
 * queued once, never looped. Not the priority or the mark: a redirect to
 * ingress zeroes skb->priority (____dev_forward_skb), and the mark is a
 * setting the pod's rules match on; the hash survives the redirect, as it
 * does a veth's crossing. A sender whose SYN carries it by chance only gets
 * that SYN dropped, and only when its tuple is in TIME_WAIT. */
#define HASH_SYN_REQUEUED 0x72640002

/* skb->hash that rd_host_egress gives a packet it translated to the probe
 * SNAT source, so the pod-side capture can tell it from a spoofed one: the
 * hash survives the veth's crossing into the pod's namespace, where the mark
 * and priority are reset, and no sender chooses its own packets' hash. */
#define HASH_PROBE_SNAT 0x72640001

/* Value of rd_pod_netns (key: the inode number of a pod's network
 * namespace): the pod whose interface there the programs are attached to,
 * named by one of its enrolled addresses. It lets the programs tell, for a
 * packet whose own addresses are not enrolled (a link-local or SLAAC address
 * of the pod, a stacked VLAN tag), that it is still an enrolled pod's. It
 * counts only while rd_pods holds addr with this pod_id: the enrollment
 * entry stays the kill switch. */
struct pod_netns {
	struct pod_addr addr;
	__u32 pod_id;
	__u32 _pad;
};

/* Key of rd_dialled (capture.c): an egress packet's own tuple, the
 * addresses IPv4-mapped as in rd_pods. */
struct dialled_key {
	struct pod_addr src;
	struct pod_addr dst;
	__be16 sport;
	__be16 dport;
};

#define POD_META_MAX_ADDRS 4

/* How the programs were attached to a pod's interface. */
enum attach_mode {
	ATTACH_TCX = 1,       /* tcx links, pinned under <root>/pods/<id>/ */
	ATTACH_TC_LEGACY = 2, /* clsact qdisc + cls_bpf filters (kernels without tcx) */
};

/* Value of the pod-metadata map: what the loader attached for one pod, so a
 * restarted agent, `redirector inspect` and `uninstall` know without any
 * other state. The programs never read it. Strings are NUL-padded. */
struct pod_meta {
	char uid[64];
	char namespace[64];
	char name[128];
	char netns[192];      /* path of the pod's network namespace */
	char ifname[16];      /* the pod interface */
	struct pod_addr addrs[POD_META_MAX_ADDRS];
	__u32 naddrs;
	__u32 flags;          /* enum pod_flag bits, as in rd_pods */
	__u32 attach_mode;    /* enum attach_mode */
	__s32 accept_local;   /* interface sysctl values before attach, restored on detach */
	__s32 rp_filter;
	__s32 rp_filter_all;  /* the namespace's "all" before attach; was padding, so 0 in entries of older agents */
};
