package policy

import (
	"iter"
	"slices"
	"strings"
)

// Index holds one state's policies by where they can apply, so that
// deciding a connection walks only those, not every policy of the mesh.
// Which policies apply and in what order they are read is as Authorize,
// EffectiveMode and CompiledSet.Authorize read the whole lists.
//
// Without it a connection cost a walk of every policy: at 200k compiled
// policies in other namespaces (the xDS source's bound per type) 2.4 ms
// per inbound connection on every node, and each policy change re-decides
// every open connection. A pod selected by 10k policies of its own
// namespace made each of its connections cost a second of CPU (every
// selected key looked for in every policy, and every policy's key in the
// selected list): a tenant who may write policies in its namespace, and
// connect to its own pod, could take the agent's CPU from every pod of
// the node. Built once per state, in O(policies).
type Index struct {
	root     string
	compiled *CompiledSet
	// Positions in compiled.Policies: ScopeGlobal ones, ScopeNamespace
	// ones by namespace, and every policy by Key (what workloads list):
	// the first of a key, and from each the next of its key (-1: none).
	global      []int
	byNamespace map[string][]int
	firstOfKey  map[policyKey]int
	nextOfKey   []int
	// Positions of the hand-written policies, by namespace.
	aps   []AuthorizationPolicy
	apsIn map[string][]int
	pas   []PeerAuthentication
	pasIn map[string][]int
}

// NewIndex indexes compiled (nil: none), and aps and pas under
// rootNamespace ("" is istio-system). The index reads the slices and the
// set as they are, so they must not change while it is in use.
func NewIndex(compiled *CompiledSet, aps []AuthorizationPolicy, pas []PeerAuthentication, rootNamespace string) *Index {
	if rootNamespace == "" {
		rootNamespace = DefaultRootNamespace
	}
	x := &Index{root: rootNamespace, compiled: compiled, aps: aps, pas: pas,
		byNamespace: map[string][]int{}, apsIn: map[string][]int{}, pasIn: map[string][]int{}}
	if compiled != nil {
		ps := compiled.Policies
		x.firstOfKey, x.nextOfKey = make(map[policyKey]int, len(ps)), make([]int, len(ps))
		for i := len(ps) - 1; i >= 0; i-- {
			k := policyKey{ps[i].Namespace, ps[i].Name}
			x.nextOfKey[i] = -1
			if j, ok := x.firstOfKey[k]; ok {
				x.nextOfKey[i] = j
			}
			x.firstOfKey[k] = i
		}
		for i, p := range ps {
			switch p.Scope {
			case ScopeGlobal:
				x.global = append(x.global, i)
			case ScopeNamespace:
				x.byNamespace[p.Namespace] = append(x.byNamespace[p.Namespace], i)
			}
		}
	}
	for i := range aps {
		x.apsIn[aps[i].Namespace] = append(x.apsIn[aps[i].Namespace], i)
	}
	for i := range pas {
		x.pasIn[pas[i].Namespace] = append(x.pasIn[pas[i].Namespace], i)
	}
	return x
}

// Authorize decides a connection to dst, the workload namespace/name:
// with the compiled set, as CompiledSet.Authorize; else with the
// hand-written policies, as Authorize.
func (x *Index) Authorize(dst Target, workload string, src Peer) Verdict {
	if x.compiled != nil {
		return x.compiled.authorize(x, dst, workload, src)
	}
	return authorize(inOrder(x.aps, x.apsIn[x.root], x.apsIn[dst.Namespace]), x.root, dst, src)
}

// EffectiveMode is EffectiveMode over the index's PeerAuthentications.
func (x *Index) EffectiveMode(podNamespace string, podLabels map[string]string, port uint16) Decision {
	return effectiveMode(inOrder(x.pas, x.pasIn[x.root], x.pasIn[podNamespace]), x.root, podNamespace, podLabels, port)
}

// policyKey is a compiled policy's Key, as a map key that costs no
// string to make.
type policyKey struct{ namespace, name string }

// keyOf splits key (namespace/name) as Key joins it.
func keyOf(key string) policyKey {
	ns, name, _ := strings.Cut(key, "/")
	return policyKey{ns, name}
}

// holds reports whether the compiled set holds a policy of key.
func (x *Index) holds(key string) bool {
	_, ok := x.firstOfKey[keyOf(key)]
	return ok
}

// applicableCompiled yields the compiled policies that apply to a
// workload in namespace listing selected, in the set's order, each once.
func (x *Index) applicableCompiled(namespace string, selected []string) iter.Seq[*Compiled] {
	pos := slices.Concat(x.global, x.byNamespace[namespace])
	for _, k := range selected {
		i, ok := x.firstOfKey[keyOf(k)]
		for ; ok && i >= 0; i = x.nextOfKey[i] {
			if s := x.compiled.Policies[i].Scope; s != ScopeGlobal && s != ScopeNamespace {
				pos = append(pos, i)
			}
		}
	}
	slices.Sort(pos)
	pos = slices.Compact(pos)
	return func(yield func(*Compiled) bool) {
		for _, i := range pos {
			if !yield(x.compiled.Policies[i]) {
				return
			}
		}
	}
}

// inOrder yields the elements of list at the positions of a and b (each
// ascending; the same list twice when the namespaces are one), in list's
// order, each once.
func inOrder[T any](list []T, a, b []int) iter.Seq[*T] {
	return func(yield func(*T) bool) {
		i, j := 0, 0
		for i < len(a) || j < len(b) {
			var k int
			switch {
			case j == len(b) || i < len(a) && a[i] < b[j]:
				k, i = a[i], i+1
			case i == len(a) || b[j] < a[i]:
				k, j = b[j], j+1
			default: // equal
				k, i, j = a[i], i+1, j+1
			}
			if !yield(&list[k]) {
				return
			}
		}
	}
}
