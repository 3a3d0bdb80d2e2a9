package policy

import (
	"fmt"
	"iter"
	"strings"
)

// DefaultRootNamespace is Istio's default root namespace: policies without
// a selector there are mesh-wide.
const DefaultRootNamespace = "istio-system"

// Decision is the effective PeerAuthentication mode for one pod port and
// which policy decided it, for logs and the config dump.
type Decision struct {
	Mode MTLSMode
	// Source names the deciding policy and level, for example
	// "shop/db-strict (workload, port 5432)", "shop/default (namespace)",
	// "istio-system/default (mesh)", or "default (no policy)".
	Source string
}

// Strict reports whether the port accepts only mTLS (HBONE) connections. In
// ambient mode DISABLE behaves as PERMISSIVE does: the node's tunnel has
// no sidecar to turn off, so both accept plaintext and mTLS alike.
func (d Decision) Strict() bool { return d.Mode == ModeStrict }

// EffectiveMode resolves the PeerAuthentications that apply to a pod port
// with Istio's precedence, most specific first:
//
//  1. portLevelMtls of the workload policy, for that port;
//  2. the workload policy: one with a non-empty selector in the pod's
//     namespace matching podLabels (the oldest by creationTimestamp, then
//     name, if several match; selector policies in the root namespace are
//     ignored, as Istio does);
//  3. the namespace policy: no selector, in the pod's namespace;
//  4. the mesh policy: no selector, in rootNamespace ("" means
//     istio-system); one there with a selector without labels (`selector:
//     {}`) counts only for pods in rootNamespace, as istiod
//     (fetchPeerAuthentications) does, so it never outranks the mesh
//     policy elsewhere;
//  5. PERMISSIVE.
//
// A level whose mode is UNSET (or absent) inherits from the next one. As in
// Istio, portLevelMtls is honoured only on a workload policy; on a namespace
// or mesh policy it is invalid and ignored.
//
// One exception copies what istiod sends ztunnel, which is stricter than
// the rule above: a port-level DISABLE on a workload policy that sets no
// mode of its own, under a STRICT namespace or mesh policy, stays STRICT
// unless that workload policy also has a PERMISSIVE port
// (convertedSelectorPeerAuthentications looks only for PERMISSIVE ports
// there, and keeps the static STRICT policy otherwise).
//
// A second exception, also stricter: when the namespace policy is one
// written `selector: {}` (or `matchLabels: {}`) and the namespace also has
// an older-or-newer policy with no selector at all, a workload policy with
// portLevelMtls is also resolved under the oldest of the latter, and the
// port is STRICT if either reading says so: istiod converts port-level
// policies against namespace policies without a selector only.
//
// A mode that is not one of Istio's (ValidatePA reports it) is read as
// STRICT: a typo must not quietly weaken what the author meant to enforce.
// So is a policy with a field this agent does not know (Unrecognized), at
// its level and on every port, whatever mode it sets.
func EffectiveMode(pas []PeerAuthentication, rootNamespace, podNamespace string, podLabels map[string]string, port uint16) Decision {
	return effectiveMode(func(yield func(*PeerAuthentication) bool) {
		for i := range pas {
			if !yield(&pas[i]) {
				return
			}
		}
	}, rootNamespace, podNamespace, podLabels, port)
}

// effectiveMode is EffectiveMode over pas in order; an Index passes only
// the policies of the root namespace and the pod's.
func effectiveMode(pas iter.Seq[*PeerAuthentication], rootNamespace, podNamespace string, podLabels map[string]string, port uint16) Decision {
	if rootNamespace == "" {
		rootNamespace = DefaultRootNamespace
	}
	// plainNamespace is the oldest namespace policy written without any
	// selector: istiod converts a workload policy's portLevelMtls against
	// it (and ztunnel enforces the result), though it picks the namespace
	// level among `selector: {}` policies too (see below).
	var mesh, namespace, plainNamespace, workload *PeerAuthentication
	for pa := range pas {
		switch {
		case !hasSelector(pa.Spec.Selector):
			if pa.Namespace == rootNamespace {
				if pa.Spec.Selector != nil && podNamespace != rootNamespace {
					continue // `selector: {}` in the root namespace: not mesh-wide in istiod
				}
				mesh = older(mesh, pa)
			} else if pa.Namespace == podNamespace {
				namespace = older(namespace, pa)
				if pa.Spec.Selector == nil {
					plainNamespace = older(plainNamespace, pa)
				}
			}
		case pa.Namespace == podNamespace && pa.Namespace != rootNamespace &&
			selects(pa.Spec.Selector, podLabels):
			workload = older(workload, pa)
		}
	}
	d := resolveMode(mesh, namespace, workload, port)
	if workload != nil && plainNamespace != namespace && !d.Strict() && listsConverted(mesh, namespace, workload) {
		// istiod lists the workload's converted policy as the namespace
		// level decides, and builds that policy under plainNamespace: what
		// it denies then, ztunnel denies. Denying what either reading
		// denies never admits what ztunnel refuses.
		if alt := resolveMode(mesh, plainNamespace, workload, port); alt.Strict() {
			under := "no namespace policy"
			if plainNamespace != nil {
				under = plainNamespace.Namespace + "/" + plainNamespace.Name
			}
			alt.Source += fmt.Sprintf("; as istiod converts %s/%s's port-level mTLS under %s, not under %s/%s",
				workload.Namespace, workload.Name, under, namespace.Namespace, namespace.Name)
			return alt
		}
	}
	return d
}

// listsConverted reports whether istiod lists the converted form of
// workload's port-level mTLS for the pod: the workload policy's own mode,
// or the mesh and namespace levels when it sets none, are at odds with one
// of its ports (a STRICT policy with a PERMISSIVE or DISABLE port, a
// PERMISSIVE or DISABLE one with a STRICT port, an unset one with a
// PERMISSIVE port under STRICT, or with a STRICT port otherwise).
func listsConverted(mesh, namespace, workload *PeerAuthentication) bool {
	if len(workload.Spec.PortLevelMTLS) == 0 {
		return false
	}
	switch mode := workload.mtlsOrNil(); {
	case mode != nil && mode.Mode == ModeStrict:
		return hasPortMode(workload, ModePermissive) || hasPortMode(workload, ModeDisable)
	case mode != nil && (mode.Mode == ModePermissive || mode.Mode == ModeDisable):
		return hasPortMode(workload, ModeStrict)
	case resolveMode(mesh, namespace, nil, 0).Strict():
		return hasPortMode(workload, ModePermissive)
	default:
		return hasPortMode(workload, ModeStrict)
	}
}

// resolveMode applies the levels of EffectiveMode, most specific last.
func resolveMode(mesh, namespace, workload *PeerAuthentication, port uint16) Decision {
	d := Decision{Mode: ModePermissive, Source: "default (no policy)"}
	apply := func(pa *PeerAuthentication, mtls *MTLS, level string) {
		if pa == nil || mtls == nil {
			return
		}
		mode, note := readMode(mtls.Mode)
		if pa.Unrecognized != "" {
			mode, note = ModeStrict, ", has a field this agent does not know, read as STRICT"
		}
		if mode == ModeUnset {
			return
		}
		d = Decision{Mode: mode, Source: pa.Namespace + "/" + pa.Name + " (" + level + note + ")"}
	}
	apply(mesh, mesh.mtlsOrNil(), "mesh")
	apply(namespace, namespace.mtlsOrNil(), "namespace")
	apply(workload, workload.mtlsOrNil(), "workload")
	if workload != nil && workload.Unrecognized == "" {
		if pm, ok := workload.Spec.PortLevelMTLS[uint32(port)]; ok {
			if d.Mode == ModeStrict && pm.Mode == ModeDisable && unsetMode(workload.Spec.MTLS) && !hasPortMode(workload, ModePermissive) {
				d.Source += fmt.Sprintf("; port %d DISABLE of %s/%s not applied: that policy sets no mode of its own and no PERMISSIVE port, as istiod",
					port, workload.Namespace, workload.Name)
				return d
			}
			apply(workload, &pm, fmt.Sprintf("workload, port %d", port))
		}
	}
	return d
}

// unsetMode reports whether m leaves the mode to the next level.
func unsetMode(m *MTLS) bool { return m == nil || m.Mode == "" || m.Mode == ModeUnset }

// hasPortMode reports whether pa sets mode on any port.
func hasPortMode(pa *PeerAuthentication, mode MTLSMode) bool {
	for _, m := range pa.Spec.PortLevelMTLS {
		if m.Mode == mode {
			return true
		}
	}
	return false
}

// mtlsOrNil is pa's mode, nil if pa is. A policy with a field this agent
// does not know decides its level even without a mode (apply reads it as
// STRICT), so its empty mode is not left to the next level.
func (pa *PeerAuthentication) mtlsOrNil() *MTLS {
	if pa == nil {
		return nil
	}
	if pa.Spec.MTLS == nil && pa.Unrecognized != "" {
		return &MTLS{}
	}
	return pa.Spec.MTLS
}

// readMode maps a written mode to the one enforced, with a note for the
// Source when they differ.
func readMode(m MTLSMode) (MTLSMode, string) {
	switch m {
	case "", ModeUnset:
		return ModeUnset, ""
	case ModeStrict, ModePermissive, ModeDisable:
		return m, ""
	default:
		return ModeStrict, fmt.Sprintf(", invalid mode %q read as STRICT", string(m))
	}
}

// older returns whichever of cur and cand Istio prefers when several
// policies compete for one level: the oldest, then the first by name, so
// the choice does not depend on list order.
func older(cur, cand *PeerAuthentication) *PeerAuthentication {
	if cur == nil {
		return cand
	}
	ct, nt := cur.CreationTimestamp, cand.CreationTimestamp
	if nt.Before(ct) || (nt.Equal(ct) && strings.Compare(cand.Name, cur.Name) < 0) {
		return cand
	}
	return cur
}

// hasSelector reports whether sel picks particular pods; Istio treats an
// empty matchLabels like no selector.
func hasSelector(sel *WorkloadSelector) bool {
	return sel != nil && len(sel.MatchLabels) > 0
}

// selects reports whether sel matches labels: every matchLabels entry must
// be present with the same value. No selector selects everything.
func selects(sel *WorkloadSelector, labels map[string]string) bool {
	if sel == nil {
		return true
	}
	for k, v := range sel.MatchLabels {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}
