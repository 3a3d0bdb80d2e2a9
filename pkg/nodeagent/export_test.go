package nodeagent

// SetMaxSealed lowers the bound on sealed pods (MaxSealed), so a test can
// reach it with a few namespaces.
func (r *Reconciler) SetMaxSealed(n int) { r.maxSealed = n }

// SetSealedSweepBatch sets how many sealed pods one link check detaches.
func (r *Reconciler) SetSealedSweepBatch(n int) { r.sweepBatch = n }
