package kubeobj

import (
	"cmp"
	"errors"
	"fmt"
	"slices"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// LastGood keeps, across the snapshots of one source, each pod's last
// translation from a well-formed object, so that a pod whose object turns
// malformed (an address that does not parse: a *selection.PodAddrError) is
// not taken for a pod that left. Translate leaves such a pod out; dropping
// it would unenroll it and let its traffic leave the mesh, failing open. A
// pod first seen malformed has no last good version and stays out. The
// zero value is ready; one LastGood serves one sequence of snapshots.
type LastGood struct {
	pods map[string]*workload.Workload // by workload.Workload.Key
}

// Keep puts back into snap the last good version of every pod errs reports
// malformed, and remembers snap's workloads for the next call. It returns
// errs with each kept pod's error saying so. Only the translated pods may
// be in snap.Workloads (call it right after Translate).
func (l *LastGood) Keep(snap *source.Snapshot, errs []error) []error {
	var kept bool
	out := make([]error, 0, len(errs))
	for _, err := range errs {
		var ae *selection.PodAddrError
		var rc *selection.RuntimeClassError
		if errors.As(err, &rc) {
			key := cmp.Or(rc.UID, rc.Namespace+"/"+rc.Name)
			i := slices.IndexFunc(snap.Workloads, func(w *workload.Workload) bool { return w.Key() == key })
			if old := l.pods[key]; old != nil && i >= 0 && KeepDecision(snap.Workloads[i], old) {
				err = KeptError{Err: err}
			}
		}
		if errors.As(err, &ae) {
			key := cmp.Or(ae.UID, ae.Namespace+"/"+ae.Name)
			if w := l.pods[key]; w != nil && w.Namespace == ae.Namespace && w.Name == ae.Name {
				// A copy: the snapshot's workloads are its own, as
				// Translate's are (a caller may complete them).
				c := *w
				snap.Workloads = append(snap.Workloads, &c)
				kept = true
				err = KeptError{Err: err}
			}
		}
		out = append(out, err)
	}
	// A pod Undecided without an error (its namespace not in view: the
	// view lags, since the API server removes a namespace only after its
	// pods) keeps its last decision if it was enrolled: detached, its
	// traffic would leave the mesh.
	for _, w := range snap.Workloads {
		why := w.Undecided
		if old := l.pods[w.Key()]; why != "" && old != nil && KeepDecision(w, old) {
			out = append(out, KeptError{Err: fmt.Errorf("pod %s cannot be judged now (%s)", w, why)})
		}
	}
	if kept {
		slices.SortStableFunc(snap.Workloads, func(a, b *workload.Workload) int {
			return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
		})
	}
	l.pods = make(map[string]*workload.Workload, len(snap.Workloads))
	for _, w := range snap.Workloads {
		l.pods[w.Key()] = w
	}
	return out
}

// KeepDecision gives w, a pod whose RuntimeClass is unknown (a
// *selection.RuntimeClassError), the enrollment of old, its version of the
// last snapshot, if old was enrolled, and reports whether it did. The API
// server lets a RuntimeClass be deleted while its pods run; their sandboxes
// keep the handler they started with, which was not a skipped one, so the
// pod stays enrolled (dropping it would let its traffic leave the mesh).
// A pod never enrolled stays out: the agent cannot tell its handler.
func KeepDecision(w, old *workload.Workload) bool {
	if !old.Enrolled || old.Key() != w.Key() || old.Namespace != w.Namespace || old.Name != w.Name {
		return false
	}
	w.Enrolled, w.Reason, w.BypassInbound, w.DNSCapture, w.Pending, w.Undecided = true, old.Reason, old.BypassInbound, old.DNSCapture, "", ""
	return true
}

// KeptError is the error of a malformed pod whose last good version was
// kept in its place, or of a pod whose RuntimeClass is gone and whose last
// decision was kept (KeepDecision).
type KeptError struct{ Err error }

func (e KeptError) Error() string {
	return fmt.Sprintf("%v; keeping the pod's last good version", e.Err)
}

func (e KeptError) Unwrap() error { return e.Err }

// SkipMessage is the log message for an error of Translate after Keep.
func SkipMessage(err error) string {
	if errors.As(err, new(KeptError)) {
		return "pod object malformed; its last good version is kept"
	}
	return "workload skipped"
}
