package selection

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// Names of the settings, as environment variables (and, lowercased with
// dashes, as flags). Errors name them so the operator knows what to fix.
const (
	EnvExcludeNamespaces  = "EXCLUDE_NAMESPACES"
	EnvSkipRuntimeClasses = "SKIP_RUNTIME_CLASSES"
)

// ParseConfig builds a Config from the comma-separated forms of
// EXCLUDE_NAMESPACES and SKIP_RUNTIME_CLASSES. Items are trimmed, empty items
// ignored, and every item must be a DNS-1123 label, as namespace names and
// RuntimeClass handlers are: a typo fails start-up instead of silently
// selecting nothing.
func ParseConfig(excludeNamespaces, skipRuntimeClasses string) (Config, error) {
	ns, err := ParseList(EnvExcludeNamespaces, excludeNamespaces)
	if err != nil {
		return Config{}, err
	}
	rc, err := ParseList(EnvSkipRuntimeClasses, skipRuntimeClasses)
	if err != nil {
		return Config{}, err
	}
	return Config{ExcludeNamespaces: ns, SkipRuntimeClasses: rc}, nil
}

// ParseList splits a comma-separated list of DNS-1123 labels; setting names
// the setting in errors.
func ParseList(setting, value string) ([]string, error) {
	var out []string
	for item := range strings.SplitSeq(value, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		if msgs := validation.IsDNS1123Label(item); len(msgs) > 0 {
			return nil, fmt.Errorf("%s: %q is not a DNS-1123 label: %s", setting, item, strings.Join(msgs, "; "))
		}
		out = append(out, item)
	}
	return out, nil
}
