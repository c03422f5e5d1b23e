"""Views: pandas + plotly over records (figures, tables, summaries, live followers). No training, no Streamlit."""
