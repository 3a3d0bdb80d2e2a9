package dnsproxy

import (
	"math/bits"
	"net/netip"
	"slices"
	"sync"
	"time"
)

// Bounds of the hedge delay: how long the proxy waits for one upstream's
// answer before it asks the next one too (still taking the first's answer
// if it comes first). 200 ms is Linux TCP's least retransmission timeout;
// 2 s has three upstreams asked, and each waited for its whole timeout,
// within the tunnel's 10 s for a query.
// An upstream not yet measured waits initialHedge (RFC 6298's first RTO);
// one that failed lately waits minHedge, as it is asked only on probation.
const (
	minHedge     = 200 * time.Millisecond
	maxHedge     = 2 * time.Second
	initialHedge = time.Second
	// maxProbation is the longest an upstream that failed is ranked after
	// the others: it is asked first again after 2 s, 4 s, ... this long,
	// each failure doubling the wait.
	maxProbation = time.Minute
	// minRTTWindow is how long the least RTT seen is kept: a better path
	// shows at once, a worse one within two of these.
	minRTTWindow = time.Minute
)

// upstream is the proxy's memory of one configured upstream resolver: how
// fast it answers and whether it failed lately. It ranks the upstreams for
// every query (rank) and sets how long each is waited for before the next
// is asked too (hedge). One per configured upstream, for the process's life.
//
// Only an exchange that got nothing from the upstream counts against it:
// no answer within its hedge delay or its timeout, a refused or
// unreachable port; and only when the upstream answered no other query
// meanwhile, so that names a pod asks which no server resolves in time (a
// pod's slow names) do not demote an upstream answering everyone else. Any
// answer (SERVFAIL and NXDOMAIN too) clears its failures. Its speed ranks
// it by the least RTT seen (slow names cannot raise it), coarsely
// (speedClass), so upstreams alike in speed stay in their configured order.
type upstream struct {
	addr netip.AddrPort
	idx  int // position in Config.Upstreams

	mu     sync.Mutex
	srtt   time.Duration // smoothed RTT (RFC 6298); 0: not measured yet
	rttvar time.Duration
	// The least RTT of this window of minRTTWindow (from minStart) and
	// of the window before (0: none): one slow answer cannot raise it,
	// only a window without a faster one; and a measure two windows old is
	// forgotten, so an upstream ranked last for being slow is measured anew.
	minCur, minPrev time.Duration
	minStart        time.Time
	lastAnswer      time.Time // when it last answered anything
	strikes         int       // failures since its last answer
	lastStrike      time.Time
}

// answered notes an answer from u (any rcode) that took rtt.
func (u *upstream) answered(now time.Time, rtt time.Duration) {
	rtt = max(rtt, 1) // 0 means not measured
	u.mu.Lock()
	defer u.mu.Unlock()
	u.lastAnswer, u.strikes = now, 0
	if u.srtt == 0 {
		u.srtt, u.rttvar = rtt, rtt/2
	} else {
		u.rttvar = (3*u.rttvar + (u.srtt - rtt).Abs()) / 4
		u.srtt = (7*u.srtt + rtt) / 8
	}
	u.rotate(now)
	if u.minCur == 0 || rtt < u.minCur {
		u.minCur = rtt
	}
}

// rotate starts a new window of the least RTT once minRTTWindow passed.
func (u *upstream) rotate(now time.Time) {
	switch since := now.Sub(u.minStart); {
	case since < minRTTWindow:
		return
	case since < 2*minRTTWindow:
		u.minPrev = u.minCur
	default:
		u.minPrev = 0
	}
	u.minCur, u.minStart = 0, now
}

// minRTT is the least RTT of the last two windows; 0: none measured.
func (u *upstream) minRTT(now time.Time) time.Duration {
	u.rotate(now)
	switch {
	case u.minCur == 0:
		return u.minPrev
	case u.minPrev == 0:
		return u.minCur
	}
	return min(u.minCur, u.minPrev)
}

// failed notes that an exchange with u sent at sent got nothing from it.
// It counts only if u answered nothing since: then it is u's, not the
// name's. It says whether it counted.
func (u *upstream) failed(now, sent time.Time) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.lastAnswer.After(sent) {
		return false
	}
	u.strikes++
	u.lastStrike = now
	return true
}

// onProbation says whether u failed lately: within 2^strikes seconds (at
// most maxProbation) of its last failure.
func (u *upstream) onProbation(now time.Time) bool {
	if u.strikes == 0 {
		return false
	}
	return now.Sub(u.lastStrike) < min(time.Second<<min(u.strikes, 6), maxProbation)
}

// hedge is how long to wait for u's answer before asking the next
// upstream too: from its RTT (RFC 6298's RTO), within minHedge and
// maxHedge.
func (u *upstream) hedge() time.Duration {
	u.mu.Lock()
	defer u.mu.Unlock()
	switch {
	case u.strikes > 0:
		return minHedge
	case u.srtt == 0:
		return initialHedge
	}
	return min(max(u.srtt+4*u.rttvar, minHedge), maxHedge)
}

// state is u's ranking state, read under its lock.
func (u *upstream) state(now time.Time) (probation bool, strikes, speed int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if p := u.onProbation(now); p {
		return true, u.strikes, 0
	}
	return false, 0, speedClass(u.minRTT(now))
}

// speedClass groups RTTs that rank alike: all under 10 ms (a cluster's
// DNS, and not measured yet), then factors of about four. Coarse, so that
// upstreams alike in speed keep their configured order rather than swap
// on noise.
func speedClass(rtt time.Duration) int {
	if rtt < 10*time.Millisecond {
		return 0
	}
	return 1 + bits.Len64(uint64(rtt/(10*time.Millisecond)))/2
}

// srttNow is u's smoothed RTT (0: not measured).
func (u *upstream) srttNow() time.Duration {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.srtt
}

// rank orders ups for a query: those not on probation first, faster (by
// least RTT, speedClass) first, then in configured order; then
// those on probation, fewest failures first.
func rank(ups []*upstream, now time.Time) []*upstream {
	type key struct {
		u              *upstream
		probation      bool
		strikes, speed int
	}
	keys := make([]key, len(ups))
	for i, u := range ups {
		p, s, sp := u.state(now)
		keys[i] = key{u, p, s, sp}
	}
	slices.SortStableFunc(keys, func(a, b key) int {
		switch {
		case a.probation != b.probation:
			if a.probation {
				return 1
			}
			return -1
		case a.strikes != b.strikes:
			return a.strikes - b.strikes
		case a.speed != b.speed:
			return a.speed - b.speed
		}
		return a.u.idx - b.u.idx
	})
	out := make([]*upstream, len(keys))
	for i, k := range keys {
		out[i] = k.u
	}
	return out
}

// newUpstreams is the memory of addrs, one each; a repeated address is
// asked once.
func newUpstreams(addrs []netip.AddrPort) []*upstream {
	var out []*upstream
	for _, a := range addrs {
		if slices.ContainsFunc(out, func(u *upstream) bool { return u.addr == a }) {
			continue
		}
		out = append(out, &upstream{addr: a, idx: len(out)})
	}
	return out
}
