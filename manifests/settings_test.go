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

// envTwins returns the environment variables a file of cmd/redirector registers with
// settings.add("flag", ENV, ...), read from the source, so that the chart cannot fall behind
// the agent's settings unnoticed. ENV is a string literal or a constant of one of the
// agent's packages.
func envTwins(t *testing.T, file string) []string {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, filepath.Join(repoRoot, file), nil, parser.SkipObjectResolution)
	if err != nil {
		t.Fatalf("read the agent's settings: %v", err)
	}
	imports := map[string]string{} // package name -> import path
	for _, imp := range f.Imports {
		path, _ := strconv.Unquote(imp.Path.Value)
		name := filepath.Base(path)
		if imp.Name != nil {
			name = imp.Name.Name
		}
		imports[name] = path
	}
	var envs []string
	ast.Inspect(f, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok || len(call.Args) < 3 {
			return true
		}
		if sel, ok := call.Fun.(*ast.SelectorExpr); !ok || sel.Sel.Name != "add" {
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
			envs = append(envs, constant(t, imports[pkg], arg.Sel.Name))
		default:
			t.Fatalf("%s: settings.add with env %T; teach this test to read it", fset.Position(arg.Pos()), arg)
		}
		return true
	})
	if len(envs) == 0 {
		t.Fatalf("%s registers no settings with settings.add; update this test to where they are now", file)
	}
	slices.Sort(envs)
	return envs
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
// `redirector uninstall`, run by node-setup, gets its settings from the same ConfigMap.
func TestChartSetsEverySetting(t *testing.T) {
	// Deliberately unset: in a pod the agent uses its in-cluster configuration.
	unset := map[string]bool{"KUBECONFIG": true}

	r := mustRender(t, renderOpts{})
	fromChart := func(c string) map[string]bool {
		set := map[string]bool{}
		for k := range r.ConfigMap.Data {
			set[k] = true
		}
		for _, e := range container(t, r.DaemonSet, c).Env {
			set[e.Name] = true
		}
		return set
	}

	run := envTwins(t, "cmd/redirector/run.go")
	agent := fromChart("agent")
	for _, env := range run {
		if !agent[env] && !unset[env] {
			t.Errorf("`redirector run` reads %s, which the chart does not set: add it to values.yaml, "+
				"templates/configmap.yaml and the README's values table", env)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(r.ConfigMap.Data)) {
		if !slices.Contains(run, k) {
			t.Errorf("the ConfigMap sets %s, which `redirector run` does not read", k)
		}
	}

	node := fromChart("node-setup")
	for _, env := range envTwins(t, "cmd/redirector/uninstall.go") {
		if !node[env] {
			t.Errorf("`redirector uninstall` (node-setup) reads %s, which the chart does not give it", env)
		}
	}
}
