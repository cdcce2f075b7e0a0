package helmtest

import (
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/strvals"
	"sigs.k8s.io/yaml"
)

// TestReadmeExamples: the copy-paste examples in README.md ("Kubernetes")
// and the chart's README install what they say. Each creates a Secret with
// kubectl and installs the chart with --set flags; rendered with those
// values, the chart must hold the pair's properties, read only keys the
// Secret has, and give the relay a configuration it accepts.
func TestReadmeExamples(t *testing.T) {
	for _, tc := range []struct{ file, section string }{
		{"../../README.md", "## Kubernetes"},
		{chartDir + "/README.md", "# outbox-relay Helm chart"},
	} {
		t.Run(tc.file, func(t *testing.T) {
			data, err := os.ReadFile(tc.file)
			if err != nil {
				t.Fatal(err)
			}
			section := sectionOf(t, string(data), tc.section)
			block := codeBlock(t, section)
			var secret, secretNS, chart, helmNS string
			secretKeys := map[string]bool{}
			values := map[string]any{}
			for _, cmd := range commands(block) {
				switch {
				case cmd[0] == "kubectl" && strings.Contains(strings.Join(cmd, " "), " create secret generic "):
					secretNS, secret = flagValue(cmd, "-n"), flagValue(cmd, "generic")
					for _, a := range cmd {
						if lit, ok := strings.CutPrefix(a, "--from-literal="); ok {
							k, _, _ := strings.Cut(lit, "=")
							secretKeys[k] = true
						}
					}
				case len(cmd) > 3 && cmd[0] == "helm" && cmd[1] == "install":
					chart, helmNS = cmd[3], flagValue(cmd, "-n")
					for i, a := range cmd {
						if a == "--set" {
							if err := strvals.ParseInto(cmd[i+1], values); err != nil {
								t.Fatalf("--set %s: %v", cmd[i+1], err)
							}
						}
					}
				}
			}
			if secret == "" || chart == "" {
				t.Fatalf("no kubectl create secret and helm install in:\n%s", block)
			}
			if chart != "deploy/helm/outbox-relay" {
				t.Errorf("helm install %s, want deploy/helm/outbox-relay", chart)
			}
			if secretNS != helmNS {
				t.Errorf("the Secret goes to namespace %q, the release to %q", secretNS, helmNS)
			}
			y, err := yaml.Marshal(values)
			if err != nil {
				t.Fatal(err)
			}
			m := mustRender(t, string(y))
			checkPair(t, m)
			if m.secret != nil {
				t.Errorf("the example renders a Secret: it brings its own")
			}
			for _, e := range container(t, m).Env {
				if e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil {
					continue
				}
				if ref := e.ValueFrom.SecretKeyRef; ref.Name != secret || !secretKeys[ref.Key] {
					t.Errorf("env %s reads key %q of Secret %q; the example creates %q with keys %v", e.Name, ref.Key, ref.Name, secret, secretKeys)
				}
			}
			if on, _ := values["serviceMonitor"].(map[string]any); on != nil && m.serviceMonitor == nil {
				t.Errorf("serviceMonitor set, none rendered")
			}
			if err := runRelay(t, m, m.configMap.Data["config.yaml"]); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// sectionOf returns the text from a heading to the next heading of the
// same or a higher level.
func sectionOf(t *testing.T, doc, heading string) string {
	t.Helper()
	start := strings.Index(doc, "\n"+heading+"\n")
	if strings.HasPrefix(doc, heading+"\n") {
		start = 0
	}
	if start < 0 {
		t.Fatalf("no heading %q", heading)
	}
	rest := doc[start+len(heading)+1:]
	level := strings.Repeat("#", strings.Index(heading, " "))
	next := regexp.MustCompile(`\n#{1,` + strconv.Itoa(len(level)) + `} `).FindStringIndex(rest)
	if next != nil {
		rest = rest[:next[0]]
	}
	return rest
}

// codeBlock returns the first ```sh block of a section.
func codeBlock(t *testing.T, section string) string {
	t.Helper()
	_, after, ok := strings.Cut(section, "```sh\n")
	if !ok {
		t.Fatalf("no ```sh block in:\n%s", section)
	}
	block, _, _ := strings.Cut(after, "```")
	return block
}

// commands splits a shell block into commands (backslash continuations
// joined) and each into words, honouring single quotes: enough for the
// examples, which use no other shell syntax.
func commands(block string) [][]string {
	var out [][]string
	for _, line := range strings.Split(strings.ReplaceAll(block, "\\\n", " "), "\n") {
		if line, _, _ = strings.Cut(line, "#"); strings.TrimSpace(line) == "" {
			continue
		}
		var words []string
		var w strings.Builder
		inWord, quoted := false, false
		for _, r := range line {
			switch {
			case r == '\'':
				quoted, inWord = !quoted, true
			case (r == ' ' || r == '\t') && !quoted:
				if inWord {
					words = append(words, w.String())
					w.Reset()
					inWord = false
				}
			default:
				w.WriteRune(r)
				inWord = true
			}
		}
		if inWord {
			words = append(words, w.String())
		}
		out = append(out, words)
	}
	return out
}

func flagValue(cmd []string, flag string) string {
	for i, a := range cmd[:len(cmd)-1] {
		if a == flag {
			return cmd[i+1]
		}
	}
	return ""
}
