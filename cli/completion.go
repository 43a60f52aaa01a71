package cli

import (
	"fmt"
	"slices"
	"strings"
)

// Shells are the shells Completion writes scripts for.
var Shells = []string{"bash", "zsh", "fish"}

// grammar is what completion knows of the command line, read from the
// synopses: the commands, each one's verbs, the flags of each command (or
// command and verb), and which flags take a value.
type grammar struct {
	commands []string
	verbs    map[string][]string // command → verbs
	flags    map[string][]string // "command" or "command verb" → flags
	global   []string
	valued   []string // flags that take a value
}

func newGrammar(synopses, globals []Synopsis) *grammar {
	g := &grammar{verbs: map[string][]string{}, flags: map[string][]string{}}
	for _, s := range synopses {
		cmd, verbs := s.Command()
		if cmd == "" {
			continue
		}
		if !slices.Contains(g.commands, cmd) {
			g.commands = append(g.commands, cmd)
		}
		keys := []string{cmd}
		if len(verbs) > 0 {
			keys = nil
			for _, v := range verbs {
				if !slices.Contains(g.verbs[cmd], v) {
					g.verbs[cmd] = append(g.verbs[cmd], v)
				}
				keys = append(keys, cmd+" "+v)
			}
		}
		for _, k := range keys {
			for _, f := range s.Flags() {
				if !slices.Contains(g.flags[k], f) {
					g.flags[k] = append(g.flags[k], f)
				}
			}
		}
		g.addValued(s.Line)
	}
	for _, s := range globals {
		g.global = append(g.global, s.Flags()...)
		g.addValued(s.Line)
	}
	return g
}

// addValued notes the flags of line followed by a placeholder (upper case)
// or a choice (a|b): they take a value.
func (g *grammar) addValued(line string) {
	fields := strings.Fields(strings.NewReplacer("[", " ", "]", " ", "(", " ", ")", " ").Replace(line))
	for i := 0; i+1 < len(fields); i++ {
		f, next := fields[i], fields[i+1]
		if !strings.HasPrefix(f, "-") || strings.HasPrefix(next, "-") || next == "|" {
			continue
		}
		if strings.ToUpper(next) == next || strings.Contains(next, "|") {
			if !slices.Contains(g.valued, f) {
				g.valued = append(g.valued, f)
			}
		}
	}
}

// Completion returns the completion script of shell (one of Shells) for
// the command lines of synopses and the flags of globals.
func Completion(shell string, synopses, globals []Synopsis) (string, error) {
	g := newGrammar(synopses, globals)
	switch shell {
	case "bash":
		return g.bash(), nil
	case "zsh":
		return g.zsh(), nil
	case "fish":
		return g.fish(), nil
	}
	return "", fmt.Errorf("no completion for %q: want one of %s", shell, strings.Join(Shells, ", "))
}

// assoc writes the entries of m as the body of a bash or zsh associative
// array assignment, in a stable order.
func assoc(m map[string][]string, order []string) string {
	var b strings.Builder
	for _, k := range order {
		if v, ok := m[k]; ok {
			fmt.Fprintf(&b, "\t[%q]=%q\n", k, strings.Join(v, " "))
		}
	}
	return b.String()
}

// flagKeys is every key of g.flags, commands first, in usage order.
func (g *grammar) flagKeys() []string {
	var keys []string
	for _, c := range g.commands {
		keys = append(keys, c)
		for _, v := range g.verbs[c] {
			keys = append(keys, c+" "+v)
		}
	}
	return keys
}

func (g *grammar) bash() string {
	return `# bash completion for vmhost; install with
#   vmhost completion bash > /etc/bash_completion.d/vmhost
# or, for this shell only: source <(vmhost completion bash)
declare -gA _vmhost_verbs=(
` + assoc(g.verbs, g.commands) + `)
declare -gA _vmhost_flags=(
` + assoc(g.flags, g.flagKeys()) + `)
_vmhost_commands=` + fmt.Sprintf("%q", strings.Join(g.commands, " ")) + `
_vmhost_global=` + fmt.Sprintf("%q", strings.Join(g.global, " ")) + `
_vmhost_valued=` + fmt.Sprintf("%q", " "+strings.Join(g.valued, " ")+" ") + `

_vmhost() {
	local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
	local cmd= verb= i w
	for ((i = 1; i < COMP_CWORD; i++)); do
		w=${COMP_WORDS[i]}
		if [[ $w == -* ]]; then
			[[ $w != *=* && $_vmhost_valued == *" $w "* ]] && ((i++))
		elif [[ -z $cmd ]]; then
			cmd=$w
		elif [[ -z $verb && -n ${_vmhost_verbs[$cmd]} ]]; then
			verb=$w
		fi
	done
	if [[ $COMP_CWORD -gt 1 && $prev == -* && $_vmhost_valued == *" $prev "* ]]; then
		COMPREPLY=($(compgen -f -- "$cur"))
	elif [[ $cur == -* ]]; then
		local key=$cmd
		[[ -n $verb ]] && key="$cmd $verb"
		COMPREPLY=($(compgen -W "${_vmhost_flags[$key]} $_vmhost_global" -- "$cur"))
	elif [[ -z $cmd ]]; then
		COMPREPLY=($(compgen -W "$_vmhost_commands" -- "$cur"))
	elif [[ -z $verb && -n ${_vmhost_verbs[$cmd]} ]]; then
		COMPREPLY=($(compgen -W "${_vmhost_verbs[$cmd]}" -- "$cur"))
	else
		COMPREPLY=($(compgen -f -- "$cur"))
	fi
}
complete -F _vmhost vmhost
`
}

func (g *grammar) zsh() string {
	return `#compdef vmhost
# zsh completion for vmhost; install with
#   vmhost completion zsh > "${fpath[1]}/_vmhost"
# or, for this shell only (after compinit): source <(vmhost completion zsh)
_vmhost() {
	local -A verbs flags
	verbs=(
` + assoc(g.verbs, g.commands) + `	)
	flags=(
` + assoc(g.flags, g.flagKeys()) + `	)
	local -a commands global valued
	commands=(` + strings.Join(g.commands, " ") + `)
	global=(` + strings.Join(g.global, " ") + `)
	valued=(` + strings.Join(g.valued, " ") + `)
	local cmd= verb= i w
	for ((i = 2; i < CURRENT; i++)); do
		w=${words[i]}
		if [[ $w == -* ]]; then
			[[ $w != *=* && ${valued[(Ie)$w]} -gt 0 ]] && ((i++))
		elif [[ -z $cmd ]]; then
			cmd=$w
		elif [[ -z $verb && -n ${verbs[$cmd]} ]]; then
			verb=$w
		fi
	done
	local prev=${words[CURRENT-1]}
	if [[ $CURRENT -gt 2 && $prev == -* && ${valued[(Ie)$prev]} -gt 0 ]]; then
		_files
	elif [[ $PREFIX == -* ]]; then
		local key=$cmd
		[[ -n $verb ]] && key="$cmd $verb"
		compadd -- ${=flags[$key]} $global
	elif [[ -z $cmd ]]; then
		compadd -- $commands
	elif [[ -z $verb && -n ${verbs[$cmd]} ]]; then
		compadd -- ${=verbs[$cmd]}
	else
		_files
	fi
}
if [[ $funcstack[1] == _vmhost ]]; then
	_vmhost "$@"
else
	compdef _vmhost vmhost
fi
`
}

// fishFlag writes a fish `complete` option for flag: -l long or -s short,
// -r when it takes a value.
func (g *grammar) fishFlag(flag string) string {
	opt := "-l " + strings.TrimPrefix(flag, "--")
	if !strings.HasPrefix(flag, "--") {
		opt = "-o " + strings.TrimPrefix(flag, "-")
		if len(flag) == 2 {
			opt = "-s " + flag[1:]
		}
	}
	if slices.Contains(g.valued, flag) {
		opt += " -r -F" // a value, often a file
	}
	return opt
}

func (g *grammar) fish() string {
	var b strings.Builder
	b.WriteString(`# fish completion for vmhost; install with
#   vmhost completion fish > ~/.config/fish/completions/vmhost.fish
complete -c vmhost -f
`)
	fmt.Fprintf(&b, "complete -c vmhost -n __fish_use_subcommand -a %q\n", strings.Join(g.commands, " "))
	for _, f := range g.global {
		fmt.Fprintf(&b, "complete -c vmhost %s\n", g.fishFlag(f))
	}
	for _, c := range g.commands {
		verbs := g.verbs[c]
		if len(verbs) > 0 {
			fmt.Fprintf(&b, "complete -c vmhost -n '__fish_seen_subcommand_from %s; and not __fish_seen_subcommand_from %s' -a %q\n",
				c, strings.Join(verbs, " "), strings.Join(verbs, " "))
			for _, v := range verbs {
				for _, f := range g.flags[c+" "+v] {
					fmt.Fprintf(&b, "complete -c vmhost -n '__fish_seen_subcommand_from %s; and __fish_seen_subcommand_from %s' %s\n", c, v, g.fishFlag(f))
				}
			}
			continue
		}
		for _, f := range g.flags[c] {
			fmt.Fprintf(&b, "complete -c vmhost -n '__fish_seen_subcommand_from %s' %s\n", c, g.fishFlag(f))
		}
	}
	return b.String()
}
