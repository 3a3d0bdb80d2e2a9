/* Types of the optional sockops acceleration (sockops.c). */
#pragma once

#include <linux/types.h>

/* One end of a local TCP connection: addresses IPv4-mapped, ports in
 * network order, and the network namespace, so that only two sockets of the
 * same namespace ever pair up. */
struct sock_key {
	__u8 local[16];
	__u8 remote[16];
	__u16 lport;
	__u16 rport;
	__u32 _pad;
	__u64 netns;
};

/* One paired socket. An app socket's sends (rd_sk_msg, which the kernel runs
 * one at a time) write sent, checked and tcp_only; tunnel is set at pairing. */
struct sock_state {
	__u64 sent;     /* bytes this socket moved into its peer's receive queue */
	__u8 checked;   /* the first send has been looked at */
	__u8 tcp_only;  /* took the TCP path once: never redirected again */
	__u8 tunnel;    /* a tunnel socket: a redirect target, never a sender */
	__u8 _pad[5];
};

/* Counters of the acceleration, per CPU. */
struct accel_counters {
	__u64 sockets;          /* sockets paired (added to the maps) */
	__u64 redirected;       /* messages moved to the peer socket directly */
	__u64 redirected_bytes;
	__u64 passed;           /* messages sent the normal way */
	__u64 fallback_no_peer; /* connections on TCP for good: no tunnel socket to send to (not yet, or gone) */
	__u64 fallback_budget;  /* ... : the peer had not read enough (budget) */
	__u64 fallback_early;   /* ... : data was queued before the socket was paired */
	__u64 unpaired;         /* sockets of this node's pods left out: a map was full, a socket
				 * still open had the same key, an app's socket asked for reports
				 * of its sends (MSG_ZEROCOPY, transmit time stamps; also when it
				 * asks once paired), or the kernel refused the socket (one with
				 * a ULP such as kTLS; a ULP set once paired falls back) */
};

/* Bytes a sender may have in its peer's receive queue, moved there but not
 * yet reported read. The queue of a socket-to-socket redirect has no backpressure:
 * past this, the connection takes the TCP path for good. */
#define REDIRECT_BUDGET (256 * 1024)
