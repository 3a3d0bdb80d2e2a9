package nodeagent

// SetMaxSealed lowers the bound on sealed pods (MaxSealed), so a test can
// reach it with a few namespaces.
func (r *Reconciler) SetMaxSealed(n int) { r.maxSealed = n }
