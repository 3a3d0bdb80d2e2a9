package tunnel

import "github.com/redirector-mesh/redirector/pkg/tunnel/hbone"

// HBONEStats sums the HBONE servers' counts over every pod served since the
// tunnel started, so the sums only grow: a pod that stops adds its final
// counts to t.retired. ConnsActive and the Handlers gauges count the pods
// served now only.
func (t *Tunnel) HBONEStats() hbone.ServerStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	sum := t.retired
	for _, p := range t.pods {
		addServerStats(&sum, p.hbone.Stats())
	}
	return sum
}

// retire keeps p's counts once it leaves t.pods. Call with t.mu held.
func (t *Tunnel) retire(p *pod) {
	s := p.hbone.Stats()
	s.ConnsActive, s.HandlersHeld, s.HandlersQueued = 0, 0, 0
	addServerStats(&t.retired, s)
	t.retiredDrops.add(p.drops())
}

func addServerStats(sum *hbone.ServerStats, s hbone.ServerStats) {
	sum.ConnsAccepted += s.ConnsAccepted
	sum.ConnsActive += s.ConnsActive
	sum.HandlersHeld += s.HandlersHeld
	sum.HandlersQueued += s.HandlersQueued
	sum.HandshakeFailures += s.HandshakeFailures
	sum.StreamsOK += s.StreamsOK
	sum.StreamsBadRequest += s.StreamsBadRequest
	sum.StreamsDenied += s.StreamsDenied
	sum.StreamsRefused += s.StreamsRefused
	sum.ConnsRefused += s.ConnsRefused
	sum.StreamsEarlyReset += s.StreamsEarlyReset
	sum.ConnsFlood += s.ConnsFlood
	sum.ConnsProtocolError += s.ConnsProtocolError
	sum.AcceptErrors += s.AcceptErrors
	sum.RefusalsCut += s.RefusalsCut
	sum.ConnsWriteStalled += s.ConnsWriteStalled
	sum.OwnCertificateDrains += s.OwnCertificateDrains
}

// HBONELimits reports the node-wide bounds on the HBONE servers' open
// connections and handshakes.
func (t *Tunnel) HBONELimits() hbone.ConnLimiterStats { return t.hboneLimits.Stats() }
