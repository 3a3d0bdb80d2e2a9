package manifests

import (
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// mainModule is the agent's module path; its packages live under repoRoot.
const mainModule = "github.com/redirector-mesh/redirector"

// agentPackage is the directory of the agent's command, whose functions register settings.
const agentPackage = "cmd/redirector"

// envTwins returns the environment variables that the function fn of cmd/redirector
// registers with settings.add("flag", ENV, ...), directly or through the package's functions
// it calls (addCAFlags(s), addLimitSettings(s), ...), read from the source, so that the chart
// cannot fall behind the agent's settings unnoticed. ENV is a string literal or a constant of
// one of the agent's packages.
func envTwins(t *testing.T, fn string) []string {
	t.Helper()
	fset := token.NewFileSet()
	dir := filepath.Join(repoRoot, agentPackage)
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("read the agent's settings: %v", err)
	}
	type decl struct {
		fn      *ast.FuncDecl
		imports map[string]string // package name -> import path
	}
	funcs := map[string]decl{} // the package's plain functions, by name
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, e.Name()), nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatalf("read the agent's settings: %v", err)
		}
		imports := map[string]string{}
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			name := filepath.Base(path)
			if imp.Name != nil {
				name = imp.Name.Name
			}
			imports[name] = path
		}
		for _, d := range f.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok && fd.Recv == nil && fd.Body != nil {
				funcs[fd.Name.Name] = decl{fd, imports}
			}
		}
	}
	if _, ok := funcs[fn]; !ok {
		t.Fatalf("no function %s in %s; update this test to where the settings are registered now", fn, agentPackage)
	}
	var envs []string
	seen := map[string]bool{}
	var visit func(name string)
	visit = func(name string) {
		d, ok := funcs[name]
		if !ok || seen[name] {
			return
		}
		seen[name] = true
		ast.Inspect(d.fn.Body, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			if id, ok := call.Fun.(*ast.Ident); ok {
				visit(id.Name) // a helper of the package; not one: ignored
				return true
			}
			if sel, ok := call.Fun.(*ast.SelectorExpr); !ok || sel.Sel.Name != "add" || len(call.Args) < 3 {
				return true
			}
			if flag, ok := call.Args[0].(*ast.BasicLit); !ok || flag.Kind != token.STRING {
				return true
			}
			switch arg := call.Args[1].(type) {
			case *ast.BasicLit:
				v, _ := strconv.Unquote(arg.Value)
				envs = append(envs, v)
			case *ast.SelectorExpr:
				pkg := arg.X.(*ast.Ident).Name
				envs = append(envs, constant(t, d.imports[pkg], arg.Sel.Name))
			default:
				t.Fatalf("%s: settings.add with env %T; teach this test to read it", fset.Position(arg.Pos()), arg)
			}
			return true
		})
	}
	visit(fn)
	if len(envs) == 0 {
		t.Fatalf("%s registers no settings with settings.add; update this test to where they are now", fn)
	}
	slices.Sort(envs)
	return slices.Compact(envs)
}

// constant returns the value of a string constant of one of the agent's packages.
func constant(t *testing.T, importPath, name string) string {
	t.Helper()
	rel, ok := strings.CutPrefix(importPath, mainModule+"/")
	if !ok {
		t.Fatalf("constant %s of %q: not a package of %s", name, importPath, mainModule)
	}
	dir := filepath.Join(repoRoot, filepath.FromSlash(rel))
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, e.Name()), nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.CONST {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, id := range vs.Names {
					if id.Name != name || i >= len(vs.Values) {
						continue
					}
					if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
						v, _ := strconv.Unquote(lit.Value)
						return v
					}
				}
			}
		}
	}
	t.Fatalf("no string constant %s in %s", name, dir)
	return ""
}

// TestChartSetsEverySetting: every setting of `redirector run` is set by the chart (the
// ConfigMap or the downward API), and the ConfigMap holds nothing the agent does not read.
// The certificate settings depend on the mode: the default profile sets istiod's, the
// standalone profile the file CA's, so the two renders together must set them all.
// `redirector uninstall`, run by node-setup, gets its settings from the same ConfigMap.
func TestChartSetsEverySetting(t *testing.T) {
	// Deliberately unset: in a pod the agent uses its in-cluster configuration.
	unset := map[string]bool{"KUBECONFIG": true}

	run := envTwins(t, "runSettings")
	fromChart := func(r *rendered, c string) map[string]bool {
		set := map[string]bool{}
		for k := range r.ConfigMap.Data {
			set[k] = true
		}
		for _, e := range container(t, r.DaemonSet, c).Env {
			set[e.Name] = true
		}
		return set
	}
	agent := map[string]bool{}
	for _, p := range []string{"default", "standalone"} {
		r := mustRender(t, renderOpts{set: []string{"profile=" + p}})
		maps.Copy(agent, fromChart(r, "agent"))
		for _, k := range slices.Sorted(maps.Keys(r.ConfigMap.Data)) {
			if !slices.Contains(run, k) {
				t.Errorf("profile %s: the ConfigMap sets %s, which `redirector run` does not read", p, k)
			}
		}
		if p == "default" {
			for _, env := range envTwins(t, "runUninstall") {
				if !fromChart(r, "node-setup")[env] {
					t.Errorf("`redirector uninstall` (node-setup) reads %s, which the chart does not give it", env)
				}
			}
		}
	}
	for _, env := range run {
		if !agent[env] && !unset[env] {
			t.Errorf("`redirector run` reads %s, which the chart does not set: add it to values.yaml, "+
				"templates/configmap.yaml and the README's values table", env)
		}
	}
}
