//go:build tools

// Package h2spectool only records the h2spec command as a dependency.
package h2spectool

import _ "github.com/summerwind/h2spec/cmd/h2spec"
