package kubernetes

import (
	"context"
	"encoding/json"
	"errors"
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
// any pod's image or command.
//
// uid is the pod the agent means ("" for a mirror pod, which the agent knows by name): the
// patch carries it, and the API server refuses it when the pod of that name has another (the
// UID is immutable), so a pod deleted and recreated under the same name (a StatefulSet's)
// before the agent saw it is not annotated for the one that left. Before, a late "enabled"
// marked the new pod redirected before it was, and a late removal took the mark off it.
// Removing the annotation from a pod that no longer exists, or was replaced, succeeds: that
// pod is unenrolled either way.
func (a *Annotator) SetRedirection(ctx context.Context, namespace, name, uid string, enabled bool) error {
	var value any // nil: JSON null deletes the key
	if enabled {
		value = "enabled"
	}
	meta := map[string]any{"annotations": map[string]any{RedirectionAnnotation: value}}
	if uid != "" {
		meta["uid"] = uid
	}
	patch, _ := json.Marshal(map[string]any{"metadata": meta}) // strings and null only: cannot fail
	_, err := a.client.CoreV1().Pods(namespace).Patch(ctx, name, types.MergePatchType, patch,
		metav1.PatchOptions{FieldManager: fieldManager}, "status")
	replaced := uid != "" && uidRefused(err)
	switch {
	case err == nil, (apierrors.IsNotFound(err) || replaced) && !enabled:
		return nil
	case replaced:
		return fmt.Errorf("annotate pod %s/%s with %s: the pod of that name is not %s (replaced): %w", namespace, name, RedirectionAnnotation, uid, err)
	case enabled:
		return fmt.Errorf("annotate pod %s/%s with %s: %w", namespace, name, RedirectionAnnotation, err)
	default:
		return fmt.Errorf("remove %s from pod %s/%s: %w", RedirectionAnnotation, namespace, name, err)
	}
}

// uidRefused reports whether err is the API server refusing a patch for its metadata.uid,
// the answer when the pod of that name has another UID.
func uidRefused(err error) bool {
	var status apierrors.APIStatus
	if !apierrors.IsInvalid(err) || !errors.As(err, &status) || status.Status().Details == nil {
		return false
	}
	for _, c := range status.Status().Details.Causes {
		if c.Field == "metadata.uid" {
			return true
		}
	}
	return false
}
