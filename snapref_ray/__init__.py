"""snapref-ray: distributed SnapRef rendering on Anima with Ray and Ray Serve."""

__version__ = "0.1.0"
