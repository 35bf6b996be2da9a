// Command jitprof tells where the live time of the loaded relay program goes,
// by source line, from timer samples: the VMs we benchmark on have no
// hardware PMU, so perf samples on cpu-clock, and perf cannot annotate a JIT
// image without libbfd. jitprof maps the samples to source lines through the
// program's JIT line table instead.
//
//	jitprof lines > lines.txt           # as root, while the relay program is loaded
//	perf record -e cpu-clock -F 20000 -a -g -o perf.data -- sleep 20   # under traffic
//	perf script -F ip,sym,symoff -i perf.data | jitprof report lines.txt
//
// The report has two tables: what the samples with the program on the stack
// were executing (the program itself, its subprograms, the helpers it
// called), and the program's own samples by source line.
package main

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
)

const progName = "xdp_turn_relay"

func main() {
	var err error
	switch {
	case len(os.Args) == 2 && os.Args[1] == "lines":
		err = lines(os.Stdout)
	case len(os.Args) == 3 && os.Args[1] == "report":
		err = report(os.Args[2], os.Stdin, os.Stdout)
	default:
		fmt.Fprintln(os.Stderr, "usage: jitprof lines > lines.txt | perf script -F ip,sym,symoff | jitprof report lines.txt")
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "jitprof:", err)
		os.Exit(1)
	}
}

// lines writes "tag offset file:line source" for every line info of every
// loaded relay program, offsets from the start of its main function.
func lines(w io.Writer) error {
	found := 0
	for id := ebpf.ProgramID(0); ; {
		next, err := ebpf.ProgramGetNextID(id)
		if errors.Is(err, os.ErrNotExist) {
			break
		}
		if err != nil {
			return fmt.Errorf("list programs: %w", err)
		}
		id = next
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue // gone meanwhile
		}
		info, err := p.Info()
		_ = p.Close()
		if err != nil || info.Name != progName {
			continue
		}
		if err := programLines(w, info); err != nil {
			return fmt.Errorf("program %d: %w", id, err)
		}
		found++
	}
	if found == 0 {
		return fmt.Errorf("no %s program is loaded", progName)
	}
	return nil
}

func programLines(w io.Writer, info *ebpf.ProgramInfo) error {
	ksyms, ok := info.JitedKsymAddrs()
	if !ok || len(ksyms) == 0 {
		return errors.New("no JIT symbols (is the JIT on, and are we root?)")
	}
	addrs, ok := info.JitedLineInfos()
	if !ok {
		return errors.New("no JIT line info")
	}
	infos, err := info.LineInfos()
	if err != nil {
		return fmt.Errorf("line info: %w", err)
	}
	if len(infos) != len(addrs) {
		return fmt.Errorf("%d line infos, %d JIT addresses", len(infos), len(addrs))
	}
	bw := bufio.NewWriter(w)
	for i, li := range infos {
		off := int64(addrs[i]) - int64(ksyms[0])
		if off < 0 {
			continue
		}
		fmt.Fprintf(bw, "%s %x %s:%d %s\n", info.Tag, off, strings.TrimPrefix(li.Line.FileName(), "././"),
			li.Line.LineNumber(), strings.Join(strings.Fields(li.Line.Line()), " "))
	}
	return bw.Flush()
}

type lineInfo struct {
	off  int64
	line string
}

var frame = regexp.MustCompile(`^\s*[0-9a-f]+\s+(\S+?)(?:\+0x([0-9a-f]+))?(?:\s|$)`)

// report reads perf script output (ip,sym,symoff; with or without call
// chains) and the line table.
func report(linesPath string, in io.Reader, w io.Writer) error {
	table := map[string][]lineInfo{}
	data, err := os.ReadFile(linesPath)
	if err != nil {
		return err
	}
	for _, l := range strings.Split(string(data), "\n") {
		f := strings.SplitN(l, " ", 3)
		if len(f) < 3 {
			continue
		}
		off, err := strconv.ParseInt(f[1], 16, 64)
		if err != nil {
			return fmt.Errorf("%s: %q: %w", linesPath, l, err)
		}
		table[f[0]] = append(table[f[0]], lineInfo{off, f[2]})
	}
	for _, t := range table {
		slices.SortFunc(t, func(a, b lineInfo) int { return cmp.Compare(a.off, b.off) })
	}

	leaves, bySource := map[string]int{}, map[string]int{}
	onStack, own := 0, 0
	var sample []string // symbols, leaf first
	var leafOff int64
	flush := func() {
		defer func() { sample = sample[:0] }()
		if !slices.ContainsFunc(sample, func(s string) bool { return strings.HasSuffix(s, "_"+progName) }) {
			return
		}
		onStack++
		leaves[sample[0]]++
		tag, ok := strings.CutPrefix(sample[0], "bpf_prog_")
		if !ok || !strings.HasSuffix(tag, "_"+progName) {
			return
		}
		tag = strings.TrimSuffix(tag, "_"+progName)
		off := leafOff
		t := table[tag]
		i, found := slices.BinarySearchFunc(t, off, func(l lineInfo, off int64) int { return cmp.Compare(l.off, off) })
		if !found {
			i--
		}
		src := "(no line table for program " + tag + ")"
		if i >= 0 && len(t) > 0 {
			src = t[i].line
		}
		own++
		bySource[src]++
	}
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if strings.TrimSpace(l) == "" {
			flush()
			continue
		}
		if m := frame.FindStringSubmatch(l); m != nil {
			if len(sample) == 0 {
				leafOff, _ = strconv.ParseInt(m[2], 16, 64)
			}
			sample = append(sample, m[1])
		}
	}
	flush()
	if err := sc.Err(); err != nil {
		return err
	}
	if onStack == 0 {
		return fmt.Errorf("no sample has %s on its stack", progName)
	}
	fmt.Fprintf(w, "%d samples with %s on the stack, by what was running:\n", onStack, progName)
	top(w, leaves, onStack, 20)
	fmt.Fprintf(w, "\n%d samples in the program itself, by source line:\n", own)
	top(w, bySource, own, 40)
	return nil
}

func top(w io.Writer, counts map[string]int, total, n int) {
	keys := make([]string, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int { return cmp.Or(cmp.Compare(counts[b], counts[a]), cmp.Compare(a, b)) })
	for _, k := range keys[:min(n, len(keys))] {
		fmt.Fprintf(w, "%7d %5.1f%%  %s\n", counts[k], 100*float64(counts[k])/float64(total), k)
	}
}
