package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
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
