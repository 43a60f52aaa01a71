package cli

import (
	"encoding/json"
	"fmt"
	"net/url"
	"slices"
	"strings"
)

// labelFilters are the --label flags of a list or `vmhost events`: each
// "key=value" or "key", sent as ?label= (all must match). The agent checks
// them (400 for a malformed one).
type labelFilters []string

func (l *labelFilters) String() string { return strings.Join(*l, ",") }

func (l *labelFilters) Set(v string) error {
	*l = append(*l, v)
	return nil
}

// query is the filters as a query string ("?label=a%3Db&label=c"), or "".
func (l labelFilters) query() string {
	if len(l) == 0 {
		return ""
	}
	q := url.Values{"label": l}
	return "?" + q.Encode()
}

// labelEdit turns the arguments of `vmhost vm label ID …` into the body of
// PATCH .../labels: "key=value" sets a label, "key-" deletes one.
func labelEdit(name string, args []string) ([]byte, error) {
	if len(args) == 0 {
		return nil, usageError("%s: want KEY=VALUE or KEY- after the VM id", name)
	}
	edit := map[string]*string{}
	for _, a := range args {
		if k, v, ok := strings.Cut(a, "="); ok {
			if k == "" {
				return nil, usageError("%s: %q has no key", name, a)
			}
			edit[k] = &v
			continue
		}
		k, ok := strings.CutSuffix(a, "-")
		if !ok || k == "" {
			return nil, usageError("%s: %q is neither KEY=VALUE nor KEY-", name, a)
		}
		edit[k] = nil
	}
	return json.Marshal(edit)
}

// labelLine is how a VM table shows the labels of one VM: "k=v, k2=v2"
// by key.
func labelLine(l map[string]string) string {
	keys := make([]string, 0, len(l))
	for k := range l {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%s", k, l[k])
	}
	return strings.Join(parts, ", ")
}
