// Module h2spectool pins h2spec, the HTTP/2 conformance suite that
// pkg/tunnel/hbone's TestH2Spec runs against hbone.Server (see hack/h2spec.sh).
// It is a separate module so the project's go.mod does not inherit its
// dependencies.
module github.com/redirector-mesh/redirector/test/h2spectool

go 1.26.0

require github.com/summerwind/h2spec v2.2.1+incompatible

require (
	github.com/fatih/color v1.19.0 // indirect
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/mattn/go-colorable v0.1.14 // indirect
	github.com/mattn/go-isatty v0.0.20 // indirect
	github.com/spf13/cobra v1.10.2 // indirect
	github.com/spf13/pflag v1.0.9 // indirect
	golang.org/x/net v0.62.0 // indirect
	golang.org/x/sys v0.49.0 // indirect
	golang.org/x/text v0.43.0 // indirect
)
