package kubeobj

import (
	"context"
	"log/slog"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
)

// Source is a source.Source over an ObjectSource: each set of objects it
// reads is translated (Translate) into one snapshot. What the translation
// leaves out is logged, naming the object; a pod whose address stopped
// parsing keeps its last good version (LastGood).
type Source struct {
	objects ObjectSource
	cfg     selection.Config
	log     *slog.Logger
	last    LastGood
}

// NewSource translates what objects reads with the selection rules cfg.
func NewSource(objects ObjectSource, cfg selection.Config, log *slog.Logger) *Source {
	if log == nil {
		log = slog.Default()
	}
	return &Source{objects: objects, cfg: cfg, log: log}
}

// Objects is the source it translates (for readiness and metrics).
func (s *Source) Objects() ObjectSource { return s.objects }

// Run runs the object source, translating each update.
func (s *Source) Run(ctx context.Context, update func(source.Snapshot)) error {
	return s.objects.Run(ctx, func(objs Objects) {
		snap, errs := Translate(objs, s.cfg)
		for _, err := range s.last.Keep(&snap, errs) {
			s.log.Error(SkipMessage(err), "error", err)
		}
		update(snap)
	})
}
