package main

import (
	"fmt"
	"os"

	"github.com/redirector-mesh/redirector/pkg/identity"
)

// runCA handles `redirector ca init`: a file CA every node agent can read.
func runCA(args []string) error {
	if len(args) == 0 || args[0] != "init" {
		return fmt.Errorf("usage: redirector ca init --dir DIR [--trust-domain cluster.local]")
	}
	s := newSettings("ca init")
	dir := s.add("dir", "CA_DIR", "", "directory to create the root key and certificate in")
	td := s.add("trust-domain", "TRUST_DOMAIN", "cluster.local", "SPIFFE trust domain of the mesh")
	if err := s.parse(args[1:]); err != nil {
		return err
	}
	if err := s.require(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(*dir, 0o755); err != nil {
		return fmt.Errorf("%s: create %s: %w", s.name(dir), *dir, err)
	}
	if err := identity.InitCA(*dir, *td); err != nil {
		return err
	}
	fmt.Printf("created CA for trust domain %s in %s\n", *td, *dir)
	return nil
}
