package main

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/redirector-mesh/redirector/pkg/tunnel"
)

// setting is one command-line flag with its environment twin. The flag wins
// over the environment, which wins over the default.
type setting struct {
	flag, env, def, usage string
	value                 *string
}

// settings is a flag set whose every flag has an env twin, so the same
// binary is configured by flags on a laptop and by env in a DaemonSet.
type settings struct {
	fs   *flag.FlagSet
	list []*setting
}

func newSettings(name string) *settings {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	return &settings{fs: fs}
}

// add registers --flag with env twin ENV and returns where its value lands.
func (s *settings) add(flagName, env, def, usage string) *string {
	st := &setting{flag: flagName, env: env, def: def, usage: usage, value: new(string)}
	s.list = append(s.list, st)
	s.fs.StringVar(st.value, flagName, def, fmt.Sprintf("%s (env %s)", usage, env))
	return st.value
}

// parse reads env twins first, then the command line over them.
func (s *settings) parse(args []string) error {
	for _, st := range s.list {
		if v, ok := os.LookupEnv(st.env); ok {
			*st.value = v
		}
	}
	return s.fs.Parse(args)
}

// name is how errors refer to a setting: both spellings, so a user finds it
// whichever way they set it.
func (s *settings) name(value *string) string {
	for _, st := range s.list {
		if st.value == value {
			return fmt.Sprintf("--%s (%s)", st.flag, st.env)
		}
	}
	return "setting"
}

// require fails naming the first empty required setting.
func (s *settings) require(values ...*string) error {
	for _, v := range values {
		if strings.TrimSpace(*v) == "" {
			return fmt.Errorf("%s is required", s.name(v))
		}
	}
	return nil
}

// addLimitSettings registers the tunnel's connection limits (see
// tunnel.Limits for what each bounds and why the defaults); the returned
// function reads them once the settings are parsed.
func addLimitSettings(s *settings) func() (tunnel.Limits, error) {
	def := tunnel.DefaultLimits()
	node := s.add("max-connections", "MAX_CONNECTIONS", strconv.Itoa(def.PerNode),
		"open connections per capture listener kind (outbound, inbound plaintext) on this node; more are reset and counted")
	pod := s.add("max-connections-per-pod", "MAX_CONNECTIONS_PER_POD", strconv.Itoa(def.PerPod),
		"open connections per capture listener kind of one pod")
	src := s.add("max-connections-per-source", "MAX_CONNECTIONS_PER_SOURCE", strconv.Itoa(def.PerSource),
		"open inbound plaintext connections from one client address on this node")
	return func() (tunnel.Limits, error) {
		var l tunnel.Limits
		for _, v := range []struct {
			dst *int
			val *string
		}{{&l.PerNode, node}, {&l.PerPod, pod}, {&l.PerSource, src}} {
			n, err := strconv.Atoi(*v.val)
			if err != nil || n < 1 {
				return l, fmt.Errorf("%s: %q is not a positive integer", s.name(v.val), *v.val)
			}
			*v.dst = n
		}
		return l, nil
	}
}
