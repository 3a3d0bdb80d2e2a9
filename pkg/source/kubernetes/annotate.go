package kubernetes

import (
	"context"
	"encoding/json"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/redirector-mesh/redirector/pkg/selection"
)

// RedirectionAnnotation marks a pod whose traffic the node's dataplane redirects, the same
// annotation Istio's CNI agent sets, so istioctl and other tools read it unchanged.
const RedirectionAnnotation = selection.RedirectionAnnotation

// fieldManager names this agent in the pods' managedFields.
const fieldManager = "redirector"

// Annotator records on pods whether the agent redirects their traffic.
type Annotator struct {
	client kubernetes.Interface
}

// NewAnnotator returns an Annotator that patches pods through cfg.
func NewAnnotator(cfg *rest.Config) (*Annotator, error) {
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return &Annotator{client: client}, nil
}

// SetRedirection sets RedirectionAnnotation to "enabled" on the pod, or removes it. It is a
// JSON merge patch of that one key, so it neither needs the pod's resourceVersion nor
// conflicts with other writers. It goes through the pods/status subresource, as Istio's CNI
// agent does: the status strategy keeps the pod's spec (and owner references) whatever the
// patch says, so the agent needs `patch pods/status`, not `patch pods`, which could rewrite
// any pod's image or command. Removing the annotation from a pod that no longer exists
// succeeds: the pod is unenrolled either way.
func (a *Annotator) SetRedirection(ctx context.Context, namespace, name string, enabled bool) error {
	var value any // nil: JSON null deletes the key
	if enabled {
		value = "enabled"
	}
	patch, _ := json.Marshal(map[string]any{ // strings and null only: cannot fail
		"metadata": map[string]any{"annotations": map[string]any{RedirectionAnnotation: value}},
	})
	_, err := a.client.CoreV1().Pods(namespace).Patch(ctx, name, types.MergePatchType, patch,
		metav1.PatchOptions{FieldManager: fieldManager}, "status")
	switch {
	case err == nil, apierrors.IsNotFound(err) && !enabled:
		return nil
	case enabled:
		return fmt.Errorf("annotate pod %s/%s with %s: %w", namespace, name, RedirectionAnnotation, err)
	default:
		return fmt.Errorf("remove %s from pod %s/%s: %w", RedirectionAnnotation, namespace, name, err)
	}
}
