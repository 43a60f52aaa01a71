package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"vmhost/disk"
)

// A docBlock is one fenced code block of a markdown page.
type docBlock struct {
	file   string
	line   int    // of the opening fence
	lang   string // "sh", "json", "text", …
	marker string // the doctest marker before an sh block: run, agent, skip
	reason string // a skip's reason
	body   string
}

// A docPage is a page's blocks and its session setting.
type docPage struct {
	file    string
	noAgent bool // <!-- doctest-session: no-agent -->
	blocks  []docBlock
}

var (
	markerLine  = regexp.MustCompile(`^<!-- doctest: (run|agent|skip)( .*)? -->$`)
	sessionLine = regexp.MustCompile(`^<!-- doctest-session: (no-agent) -->$`)
	// fenceLangs are the languages a fence may name; sh is the one whose
	// blocks run.
	fenceLangs = map[string]bool{"sh": true, "json": true, "text": true, "yaml": true}
)

// readDocPage parses path's fenced blocks and checks the rules of the
// documentation: every fence names a known language, and every sh block
// has a marker right before it saying whether and how it runs.
func readDocPage(path string) (docPage, []string) {
	page := docPage{file: path}
	var problems []string
	f, err := os.Open(path)
	if err != nil {
		return page, []string{err.Error()}
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	var lines []string
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if sessionLine.MatchString(l) {
			page.noAgent = true
		}
		if strings.HasPrefix(strings.TrimLeft(l, " "), "```") && !strings.HasPrefix(l, "```") {
			problems = append(problems, fmt.Sprintf("%s:%d: an indented fence (put fences at the start of the line)", path, i+1))
			continue
		}
		if !strings.HasPrefix(l, "```") {
			continue
		}
		b := docBlock{file: path, line: i + 1, lang: strings.TrimSpace(strings.TrimPrefix(l, "```"))}
		var body []string
		for i++; i < len(lines) && lines[i] != "```"; i++ {
			body = append(body, lines[i])
		}
		b.body = strings.Join(body, "\n") + "\n"
		if !fenceLangs[b.lang] {
			problems = append(problems, fmt.Sprintf("%s:%d: fence language %q: use sh (commands), text, json or yaml", path, b.line, b.lang))
			continue
		}
		j := b.line - 2
		for j >= 0 && strings.TrimSpace(lines[j]) == "" {
			j--
		}
		m := []string(nil)
		if j >= 0 {
			m = markerLine.FindStringSubmatch(lines[j])
		}
		switch {
		case b.lang != "sh" && m != nil:
			problems = append(problems, fmt.Sprintf("%s:%d: a doctest marker before a %s block", path, b.line, b.lang))
		case b.lang == "sh" && m == nil:
			problems = append(problems, fmt.Sprintf("%s:%d: an sh block without a marker (<!-- doctest: run|agent|skip REASON -->) before it", path, b.line))
		case b.lang == "sh":
			b.marker, b.reason = m[1], strings.TrimSpace(m[2])
			if b.marker == "skip" && b.reason == "" {
				problems = append(problems, fmt.Sprintf("%s:%d: a skipped block must say why", path, b.line))
			}
		}
		page.blocks = append(page.blocks, b)
	}
	return page, problems
}

// docPages are the pages whose examples are tested: the README and every
// guide in docs/ (docs/ref/ holds facts about other programs, not
// examples).
func docPages(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob("docs/*.md")
	if err != nil || len(pages) < 6 {
		t.Fatalf("docs/*.md: %v, %q", err, pages)
	}
	return append([]string{"README.md"}, pages...)
}

// TestDocMarkers: every shell example of the README and docs/ says
// whether the tests run it, and a skipped one says why.
func TestDocMarkers(t *testing.T) {
	var run int
	for _, path := range docPages(t) {
		page, problems := readDocPage(path)
		for _, p := range problems {
			t.Error(p)
		}
		var agents int
		for _, b := range page.blocks {
			if b.marker == "run" {
				run++
			}
			if b.marker == "agent" {
				agents++
			}
		}
		if agents > 0 && (path != "README.md" || agents > 1) {
			t.Errorf("%s: %d agent blocks; only the README's quick start starts its own agent", path, agents)
		}
	}
	if run < 20 {
		t.Errorf("only %d runnable examples in the documentation", run)
	}
}

// TestReadmeQuickStartIsFirst: the README's first commands are the two a
// newcomer needs, the agent in dev mode and the tests, and the page fits
// on two screens.
func TestReadmeQuickStartIsFirst(t *testing.T) {
	page, _ := readDocPage("README.md")
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b), "\n"); n > 110 {
		t.Errorf("README.md has %d lines; keep it to two screens and move the rest to docs/", n)
	}
	if len(page.blocks) == 0 || !strings.Contains(page.blocks[0].body, "serve --dev") || !strings.Contains(page.blocks[0].body, "go test -race ./...") {
		t.Errorf("the README's first block does not give the agent in dev mode and the test command:\n%+v", page.blocks)
	}
}

// TestDocExamples runs the examples of the README and of each guide, each
// page in network, mount and pid namespaces of its own (so bridges, the
// port 8080 and every process it starts vanish with it), in order, in one
// bash with -euo pipefail:
//   - the README's in the checkout, seen through an overlay so that its
//     commands run exactly as written (go build, ./vmhost, ./vmhost-dev)
//     without changing it; its agent block runs in the background and the
//     export lines it prints set up the shell of the blocks after it;
//   - a guide's in a fresh directory, with this package's vmhost in PATH
//     and, unless the page says no-agent, a dev agent of its own.
func TestDocExamples(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for the namespaces the examples run in: run go test as root")
	}
	unshare := distTool(t, "unshare", "util-linux")
	distTool(t, "curl", "curl")
	distTool(t, "openssl", "openssl")
	distTool(t, "qemu-img", "qemu-utils")
	repo, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	if err := os.Symlink(binary(t), filepath.Join(bin, "vmhost")); err != nil {
		t.Fatal(err)
	}
	for _, path := range docPages(t) {
		page, problems := readDocPage(path)
		if len(problems) > 0 {
			continue // TestDocMarkers reports them
		}
		t.Run(path, func(t *testing.T) {
			script, ran := docScript(t, page, repo)
			if ran == 0 {
				t.Skip("no runnable example")
			}
			dir := t.TempDir()
			t.Cleanup(func() { disk.RemoveAll(dir) }) // AppVM builds are sealed (immutable, as root)
			scriptPath := filepath.Join(dir, "examples.sh")
			os.WriteFile(scriptPath, []byte(script), 0o700)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, unshare, "--pid", "--fork", "--mount-proc", "--mount", "--net", "--propagation", "private", "bash", scriptPath)
			cmd.Dir = dir
			cmd.Env = append(os.Environ(), "T="+dir, "REPO="+repo, "VMHOST_SRC="+repo, "PATH="+bin+":"+os.Getenv("PATH"))
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Errorf("the examples of %s failed: %v\n%s", path, err, tail(string(out), 120))
			} else {
				t.Logf("%d examples of %s ran", ran, path)
				if testing.Verbose() {
					t.Log(tail(string(out), 60))
				}
			}
		})
	}
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = append([]string{fmt.Sprintf("… (%d lines before)", len(lines)-n)}, lines[len(lines)-n:]...)
	}
	return strings.Join(lines, "\n")
}

// docScript writes the bash script that runs page's examples, and says how
// many blocks it runs.
func docScript(t *testing.T, page docPage, repo string) (string, int) {
	t.Helper()
	var s strings.Builder
	s.WriteString(`set -euo pipefail
ip link set lo up
# A sysfs of this network namespace (the agent reads bridges there), with
# the host's cgroup hierarchies kept under it.
mkdir -p "$T/cgroup"
mount --rbind /sys/fs/cgroup "$T/cgroup"
mount -t sysfs sysfs /sys
mount --rbind "$T/cgroup" /sys/fs/cgroup

# agent_env waits for the agent (pid $agent) to serve and sets up the shell
# from the export lines serve --dev prints once it serves.
agent_env() {
	local i
	for i in $(seq 1 1800); do
		if grep -q '^export VMHOST_TOKEN=' "$T/agent.out"; then
			eval "$(grep '^export VMHOST_' "$T/agent.out")"
			return
		fi
		if ! kill -0 "$agent" 2>/dev/null; then
			echo "the agent exited:"; cat "$T/agent.out" "$T/agent.err"; exit 1
		fi
		sleep 0.1
	done
	echo "the agent did not start:"; cat "$T/agent.out" "$T/agent.err"; exit 1
}
stop_agent() {
	if [ -n "${agent:-}" ]; then
		# The agent, or the shell of the README's agent block and what it runs.
		local c
		for c in $(cat /proc/"$agent"/task/*/children 2>/dev/null); do kill -TERM "$c" 2>/dev/null || true; done
		kill -TERM "$agent" 2>/dev/null || true
		wait "$agent" || true
		echo "--- the agent's log:"; tail -n 20 "$T/agent.err"
	fi
}
trap stop_agent EXIT
`)
	if page.file == "README.md" {
		// The checkout through an overlay: writes go to $T/upper. A
		// developer's own ./vmhost-dev is hidden, not touched.
		fmt.Fprintf(&s, `mkdir -p "$T/upper" "$T/overlay-work"
mount -t overlay overlay -o "lowerdir=$REPO,upperdir=$T/upper,workdir=$T/overlay-work" "$REPO"
cd "$REPO"
[ "$(stat -f -c %%T .)" = overlayfs ]
rm -rf vmhost-dev vmhost
`)
	} else {
		s.WriteString("mkdir -p \"$T/work\" && cd \"$T/work\"\n")
		if !page.noAgent {
			s.WriteString(`vmhost serve --dev >"$T/agent.out" 2>"$T/agent.err" &
agent=$!
agent_env
`)
		}
	}
	ran := 0
	for _, b := range page.blocks {
		switch {
		case b.lang != "sh", b.marker == "skip":
			continue
		}
		ran++
		fmt.Fprintf(&s, "\necho '### %s:%d (%s)'\n", b.file, b.line, b.marker)
		if b.marker == "agent" {
			fmt.Fprintf(&s, "( %s) >\"$T/agent.out\" 2>\"$T/agent.err\" &\nagent=$!\nagent_env\n", b.body)
			continue
		}
		s.WriteString("set -x\n" + b.body + "{ set +x; } 2>/dev/null\n")
	}
	return s.String(), ran
}
