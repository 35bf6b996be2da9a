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

// lines writes "start:length offset file:line source" for every line info of
// every loaded relay program: the kernel address and length of its main
// function's JIT image, and the offset into it. Samples are matched by
// address: the tag in a perf symbol name need not be the one the kernel
// reports (perf 6.1 on kernel 6.18 names programs with other tags).
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
	lens, ok := info.JitedFuncLens()
	if !ok || len(lens) == 0 {
		return errors.New("no JIT function lengths")
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
		if off < 0 || off >= int64(lens[0]) {
			continue // a subprogram's
		}
		fmt.Fprintf(bw, "%x:%x %x %s:%d %s\n", ksyms[0], lens[0], off, strings.TrimPrefix(li.Line.FileName(), "././"),
			li.Line.LineNumber(), strings.Join(strings.Fields(li.Line.Line()), " "))
	}
	return bw.Flush()
}

type lineInfo struct {
	off  int64
	line string
}

// frame is a line of perf script's -F ip,sym,symoff: the address and the
// symbol (with its offset).
var frame = regexp.MustCompile(`^\s*([0-9a-f]+)\s+(\S+?)(?:\+0x[0-9a-f]+)?(?:\s|$)`)

// report reads perf script output (ip,sym,symoff; with or without call
// chains) and the line table.
func report(linesPath string, in io.Reader, w io.Writer) error {
	type image struct {
		start, end uint64
		lines      []lineInfo
	}
	var images []*image
	data, err := os.ReadFile(linesPath)
	if err != nil {
		return err
	}
	for _, l := range strings.Split(string(data), "\n") {
		f := strings.SplitN(l, " ", 3)
		if len(f) < 3 {
			continue
		}
		start, length, ok := strings.Cut(f[0], ":")
		a, err1 := strconv.ParseUint(start, 16, 64)
		n, err2 := strconv.ParseUint(length, 16, 64)
		off, err3 := strconv.ParseInt(f[1], 16, 64)
		if !ok || err1 != nil || err2 != nil || err3 != nil {
			return fmt.Errorf("%s: not a line of `jitprof lines`: %q", linesPath, l)
		}
		if len(images) == 0 || images[len(images)-1].start != a {
			images = append(images, &image{start: a, end: a + n})
		}
		im := images[len(images)-1]
		im.lines = append(im.lines, lineInfo{off, f[2]})
	}
	for _, im := range images {
		slices.SortFunc(im.lines, func(a, b lineInfo) int { return cmp.Compare(a.off, b.off) })
	}

	leaves, bySource := map[string]int{}, map[string]int{}
	onStack, own := 0, 0
	var sample []string // symbols, leaf first
	var leafIP uint64
	flush := func() {
		defer func() { sample = sample[:0] }()
		if !slices.ContainsFunc(sample, func(s string) bool { return strings.HasSuffix(s, "_"+progName) }) {
			return
		}
		onStack++
		leaves[sample[0]]++
		if !strings.HasPrefix(sample[0], "bpf_prog_") || !strings.HasSuffix(sample[0], "_"+progName) {
			return
		}
		own++
		k := slices.IndexFunc(images, func(im *image) bool { return im.start <= leafIP && leafIP < im.end })
		if k < 0 {
			bySource[fmt.Sprintf("(no line table for the program at %x)", leafIP)]++
			return
		}
		t := images[k].lines
		off := int64(leafIP - images[k].start)
		i, found := slices.BinarySearchFunc(t, off, func(l lineInfo, off int64) int { return cmp.Compare(l.off, off) })
		if !found {
			i--
		}
		src := "(before the first line)"
		if i >= 0 {
			src = t[i].line
		}
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
				leafIP, _ = strconv.ParseUint(m[1], 16, 64)
			}
			sample = append(sample, m[2])
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
